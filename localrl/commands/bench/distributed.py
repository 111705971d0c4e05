"""``localrl bench distributed``: weak scaling of data-parallel training, whole ``localrl train`` runs under
torchrun, 1 process and then 2 (localrl.benchmarks.distributed)."""

from __future__ import annotations

import argparse

from localrl.commands.bench import check_model, json_flag, print_json, repeats_flag, size_flags, sizes
from localrl.errors import UserError


def add_parser(benches) -> None:
    p = benches.add_parser("distributed", help="localrl train under torchrun, 1 process against 2 ranks with the "
                           "same work each: the step time's efficiency")
    p.add_argument("--model", default="tiny-arith", help="the model (default tiny-arith)")
    size_flags(p, prompts="8 per process", group="8", completion_len="32")
    repeats_flag(p, "timed steps after a warm-up (median reported)")
    json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from localrl.benchmarks.distributed import bench_distributed

    b, g, r = sizes(args, prompts=8, group=8, completion_len=32)
    if b < 1 or g < 2 or r < 1 or args.repeats < 1:
        raise UserError("bench distributed: need --prompts >= 1, --group >= 2, --completion-len >= 1 and "
                        "--repeats >= 1")
    check_model(args.model)
    print(f"distributed benchmark: localrl train of {args.model} under torchrun (gloo), 1 process and then 2, "
          f"each {b} prompts x G={g} x up to {r} tokens a step on one CPU thread; median of "
          f"{args.repeats} steps after a warm-up")
    print_json(args, bench_distributed(args.model, b, g, r, steps=args.repeats))
    return 0
