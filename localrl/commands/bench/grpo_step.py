"""``localrl bench grpo-step``: whole GRPO steps of localrl and of TRL's GRPOTrainer on the same model, side by
side in one process (localrl.benchmarks.grpo_step)."""

from __future__ import annotations

import argparse

from localrl.commands.bench import json_flag, model_size_flag, print_json, qwen2_model, repeats_flag, size_flags, \
    sizes


def add_parser(benches) -> None:
    p = benches.add_parser("grpo-step", help="a whole GRPO step (generation, scoring, update): localrl against "
                           "TRL's GRPOTrainer")
    size_flags(p, prompt_len="1000", completion_len="100", group="8")
    repeats_flag(p, "timed steps after a warm-up (median reported)")
    model_size_flag(p, "a tiny 4-bit Qwen2-style model")
    json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from localrl.benchmarks.grpo_step import bench_grpo_step
    from localrl.benchmarks.harness import MODEL_SHAPES

    p, r, g = sizes(args, prompt_len=1000, completion_len=100, group=8)
    print(f"grpo-step benchmark: localrl vs TRL GRPOTrainer, one prompt x G={g}, P={p}, R={r}, "
          f"{qwen2_model(args.model_size)} with LoRA, cpu, median of {args.repeats} steps after a warm-up")
    print_json(args, bench_grpo_step(prompt_len=p, completion_len=r, group=g, steps=args.repeats,
                                     model_shape=MODEL_SHAPES[args.model_size]))
    return 0
