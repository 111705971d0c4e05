"""``localrl bench prompt-cache``: the shared-prompt forward and backward against the concatenated one, same
gradients; time and peak memory side by side (localrl.benchmarks.prompt_cache)."""

from __future__ import annotations

import argparse

from localrl.commands.bench import json_flag, model_size_flag, print_json, qwen2_model, repeats_flag, size_flags, \
    sizes


def add_parser(benches) -> None:
    p = benches.add_parser("prompt-cache", help="one GRPO group's forward and backward, the prompt computed once "
                           "against once per completion")
    size_flags(p, prompt_len="1000", completion_len="100", group="8; with none of P, R, G given, two shapes: "
               "1000,100,8 and 4000,64,8")
    repeats_flag(p)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to run (default auto: cuda if this machine has a GPU)")
    model_size_flag(p, "a tiny 4-bit Qwen2-style model")
    json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from localrl.benchmarks.harness import MODEL_SHAPES
    from localrl.benchmarks.prompt_cache import PROMPT_CACHE_SHAPES, bench_prompt_cache
    from localrl.modeling import pick_device

    given = (args.prompt_len, args.completion_len, args.group)
    shape = sizes(args, prompt_len=1000, completion_len=100, group=8)
    shapes = PROMPT_CACHE_SHAPES if given == (None, None, None) else [shape]
    device = pick_device(args.device)
    print(f"prompt-cache benchmark: one GRPO group, forward+backward, {qwen2_model(args.model_size)} with LoRA, "
          f"{device.type}, median of {args.repeats}")
    print_json(args, bench_prompt_cache(shapes=shapes, repeats=args.repeats, device=device.type,
                                        model_shape=MODEL_SHAPES[args.model_size]))
    return 0

