"""``localrl baselines pong``: PPO against the predictive-coding + Hebbian agent (and, asked for, latent world
models that plan) on Pong, with intervals."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from localrl.errors import UserError


def add_parser(commands) -> None:
    """``localrl baselines``: its flags."""
    p = commands.add_parser("baselines", help="backprop-free agents against PPO, measured with confidence intervals")
    p.add_argument("env", choices=["pong"], help="environment")
    p.add_argument("--quick", action="store_true",
                   help="a shorter run for laptops: 3 seeds x 500k steps (under 10 minutes on 2 cores, with --agent "
                        "jepa too)")
    p.add_argument("--out", default="baselines-pong", help="folder for results.md, results.json, learning_curves.png")
    p.add_argument("--steps", type=int, default=None, help="training env steps per agent and seed")
    p.add_argument("--seeds", type=int, default=None, help="seeds per agent")
    p.add_argument("--eval-points", type=int, default=None, help="evaluation points per agent and seed")
    p.add_argument("--agent", action="append", choices=["jepa"], default=[],
                   help="also train this family beside PPO and PC+Hebbian: jepa (a latent world model planning with "
                        "the cross-entropy method, with a subspace prior and a full-latent one); repeatable")
    p.add_argument("--workers", type=int, default=None,
                   help="processes the runs share (default: one a core); the numbers do not depend on it")
    p.set_defaults(func=cmd_baselines)


def cmd_baselines(args: argparse.Namespace) -> int:
    import torch

    from localrl.baselines.run import QUICK, PongBenchConfig, run

    cfg = QUICK if args.quick else PongBenchConfig()
    cfg = replace(cfg, agents=tuple(dict.fromkeys(args.agent)))
    if args.steps is not None and args.steps < cfg.num_envs:
        raise UserError(f"baselines: --steps must be at least {cfg.num_envs} (one step of each of the {cfg.num_envs} "
                        f"games; got {args.steps})")
    for field in ("steps", "seeds", "eval_points", "workers"):
        value = getattr(args, field)
        if value is not None:
            if value < 1:
                raise UserError(f"baselines: --{field.replace('_', '-')} must be at least 1 (got {value})")
            if field != "workers":
                cfg = replace(cfg, **{field: value})
    if cfg.eval_points < 2000 or cfg.seeds < 3:
        print("note: fewer than 2,000 evaluation points or 3 seeds: the intervals are wide")
    torch.set_num_threads(1)  # tiny MLPs: threads cost more than they give
    out = Path(args.out)
    run(cfg, out, workers=args.workers or len(os.sched_getaffinity(0)))
    print((out / "results.md").read_text(), end="")
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'learning_curves.png'}")
    return 0
