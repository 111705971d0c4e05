"""``localrl baselines pong``: PPO against the predictive-coding + Hebbian agent on Pong, with intervals."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from localrl.errors import UserError


def cmd_baselines(args: argparse.Namespace) -> int:
    import torch

    from localrl.baselines.run import QUICK, PongBenchConfig, run

    cfg = QUICK if args.quick else PongBenchConfig()
    for field in ("steps", "seeds", "eval_points"):
        value = getattr(args, field)
        if value is not None:
            if value < 1:
                raise UserError(f"baselines: --{field.replace('_', '-')} must be at least 1 (got {value})")
            cfg = replace(cfg, **{field: value})
    if cfg.eval_points < 2000 or cfg.seeds < 3:
        print("note: fewer than 2,000 evaluation points or 3 seeds: the intervals are wide")
    torch.set_num_threads(1)  # tiny MLPs: threads cost more than they give
    out = Path(args.out)
    run(cfg, out)
    print((out / "results.md").read_text(), end="")
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'learning_curves.png'}")
    return 0
