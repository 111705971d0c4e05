"""``localrl bench utilisation``: the machine's own matrix-product peak, then one GRPO step phase by phase as
FLOP/s and as a share of that peak (localrl.benchmarks.utilisation). The CPU only."""

from __future__ import annotations

import argparse

from localrl.commands.bench import check_model, json_flag, model_size_flag, print_json, size_flags


def add_parser(benches) -> None:
    p = benches.add_parser("utilisation", help="a GRPO step's phases on this CPU as FLOP/s and as a share of the "
                           "machine's own measured peak")
    p.add_argument("--model", default=None, help="a built-in model or shape (default: tiny-arith and the "
                   "smollm2-135m shape)")
    size_flags(p, prompts="the step's", group="the step's", prompt_len="the step's", completion_len="the step's")
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="what the step's base computes in (default auto: float32 on a CPU), measured against "
                   "that dtype's peak")
    model_size_flag(p, "tiny-arith at a tiny step and a small peak matrix")
    json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from localrl.benchmarks.utilisation import PEAK_N, StepSize, bench_utilisation

    smoke = args.model_size == "tiny"
    default = StepSize(1, 2, 16, 8) if smoke else StepSize()
    given = {"prompts": args.prompts, "group": args.group, "prompt_len": args.prompt_len,
             "completion_len": args.completion_len}
    size = StepSize(**{k: getattr(default, k) if v is None else v for k, v in given.items()})
    models = [args.model] if args.model else ["tiny-arith"] if smoke else ["tiny-arith", "smollm2-135m"]
    for name in models:
        check_model(name, shapes=True)
    print("utilisation benchmark: the machine's own matrix-product peak, then one GRPO step per model, phase by "
          "phase, as FLOP/s and as a share of that peak (cpu, after a warm-up step)")
    print_json(args, bench_utilisation(models, size, peak_n=256 if smoke else PEAK_N,
                                       compute_dtype=args.compute_dtype))
    return 0
