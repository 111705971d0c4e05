"""``localrl plan``: a step's (or, with ``--budget``, a whole run's) predicted peak memory from a model's
config.json alone, as ``localrl train --memory-budget`` plans it."""

from __future__ import annotations

import argparse
from dataclasses import replace

from localrl.errors import UserError


def add_parser(commands) -> None:
    """``localrl plan``: its flags."""
    p = commands.add_parser("plan", help="predict a GRPO step's peak memory and choose micro-batches for a budget")
    p.add_argument("--model", default="tiny-arith", help="model directory, config.json, or built-in name")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--prompts", type=int, default=1, help="prompts per step")
    p.add_argument("--prompt-len", type=int, required=True, help="prompt tokens (P)")
    p.add_argument("--completion-len", type=int, required=True, help="completion tokens (R)")
    p.add_argument("--budget", default="", help="memory budget, for example 12GB (empty: no limit)")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank of the adapter (default 16)")
    p.add_argument("--quantize", default="auto", choices=["auto", "nf4", "none"],
                   help="base weights, as in train (auto: nf4 on cuda, full precision on cpu unless memory needs nf4)")
    p.add_argument("--no-4bit", action="store_true", help="the same as --quantize none")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="the device to plan for (default auto: this machine's: cuda if it has a GPU, else cpu); "
                        "4-bit only on cuda")
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="what the base computes in, as in train (auto: bfloat16 on cuda, float32 on a CPU)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from localrl.config import TrainConfig
    from localrl.memory import MemoryBudget, choose_4bit, parse_bytes, plan_step, read_shape
    from localrl.precision import resolve

    if args.group < 2 or args.prompt_len < 1 or args.completion_len < 1 or args.prompts < 1:
        raise UserError("plan: need --group >= 2 and positive --prompts, --prompt-len and --completion-len")
    if args.budget:
        parse_bytes(args.budget, "budget", "plan: --budget")
    shape = read_shape(args.model)
    if shape.context and args.prompt_len + args.completion_len > shape.context:
        raise UserError(f"plan: --prompt-len {args.prompt_len} and --completion-len {args.completion_len} make "
                        f"{args.prompt_len + args.completion_len} tokens; {args.model} holds {shape.context}")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype, why_dtype = resolve(args.compute_dtype, torch.device(device))
    dtype_bytes = dtype.itemsize
    quantize = "none" if args.no_4bit else args.quantize
    cfg = TrainConfig(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.completion_len,
                      lora_rank=args.lora_rank, quantize=quantize, memory_budget=args.budget,
                      compute_dtype=args.compute_dtype).validate()
    if not args.budget:  # the update alone, as configured: no budget, not this machine's free memory
        cfg = replace(cfg, eval_size=0)
    in_4bit, why = choose_4bit(cfg, shape, args.prompt_len, torch.device(device)) if args.budget else (
        quantize == "nf4" or (quantize == "auto" and device == "cuda"), f"quantize = {quantize}")
    print(f"base: {why}")
    print(f"{args.model}: {shape.layers} layers, hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads, "
          f"vocab {shape.vocab}; {args.prompts} prompt(s) x G={args.group}, P={args.prompt_len}, "
          f"R={args.completion_len}, {device}, {why_dtype}"
          + (" (this machine's device; --device cuda plans for a GPU)" if args.device == "auto" and device == "cpu"
             else ""))
    if not args.budget:
        print(plan_step(shape, args.prompts, args.group, args.prompt_len, args.completion_len, None, args.lora_rank,
                        in_4bit, dtype_bytes).describe())
        return 0
    # the whole run under the budget, as `localrl train --memory-budget` plans it
    run = MemoryBudget(shape, cfg, torch.device(device), in_4bit)
    plan = run.plan(args.prompt_len, args.completion_len)
    print(plan.describe())
    try:
        run.check(args.prompt_len, args.completion_len)
    except UserError as e:
        print("DOES NOT FIT: " + str(e).removeprefix("config field memory_budget: "))
        return 1
    print("\n".join(run.describe(args.prompt_len, args.completion_len)))
    return 0
