"""``localrl bench memory``: each phase of one GRPO step in a fresh process, the planner's predicted peak against
the measured one (localrl.benchmarks.memory_phases)."""

from __future__ import annotations

import argparse

from localrl.commands.bench import check_model, json_flag, print_json, size_flags
from localrl.errors import UserError
from localrl.precision import CHOICES


def add_parser(benches) -> None:
    p = benches.add_parser("memory", help="each phase of a GRPO step in a fresh process: the planner's predicted "
                           "peak against the measured one, under a budget")
    p.add_argument("--model", default=None, help="a model directory, built-in name or shape (default: the "
                   "smollm2-135m and qwen2.5-0.5b shapes at budgets that make the planner split)")
    p.add_argument("--budget", action="append", help="a memory budget for --model (repeatable; default: the free "
                   "memory)")
    p.add_argument("--quantize", default="none", choices=["none", "nf4"], help="--model's base weights")
    size_flags(p, prompts="each case's", group="each case's", prompt_len="each case's",
               completion_len="each case's")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run (default cpu; cuda "
                   "measures max_memory_allocated)")
    p.add_argument("--compute-dtype", default="auto", choices=list(CHOICES),
                   help="what the base computes in, as in train (default auto)")
    json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from localrl.benchmarks.memory_phases import DEFAULT_CASES, MemoryCase, bench_memory

    sizes = {k: v for k, v in (("prompts", args.prompts), ("group", args.group), ("prompt_len", args.prompt_len),
                                ("completion_len", args.completion_len)) if v is not None}
    if any(v < 1 for v in sizes.values()) or sizes.get("group", 2) < 2:
        raise UserError("bench memory: need --group >= 2 and positive --prompts, --prompt-len, --completion-len")
    if args.budget and not args.model:
        raise UserError("bench memory: --budget is for --model (the default cases carry their own budgets)")
    cases = [MemoryCase(args.model, args.quantize, b) for b in (args.budget or [""])] if args.model \
        else list(DEFAULT_CASES)
    cases = [replace(c, **sizes, compute_dtype=args.compute_dtype) for c in cases]
    for case in cases:
        check_model(case.model, shapes=True)
    print(f"memory benchmark: each phase of one GRPO step in a fresh process, {args.device}; predicted (the "
          f"planner) vs measured peak of the whole process "
          f"({'resident set' if args.device == 'cpu' else 'max_memory_allocated'})")
    rows = bench_memory(cases, device=args.device)
    print_json(args, rows)
    return 0 if all(r["under_budget"] for r in rows) else 1
