"""The ``localrl`` command: parse, validate, call the library. Nothing here a user could not call from Python.

    localrl train [--config FILE.toml] [--resume RUN_DIR] [--FIELD VALUE ...]
    localrl eval [RUN_DIR] [--model M] [--data D] [--eval-size N] [--no-4bit]
    localrl models build NAME | localrl models list
    localrl export SOURCE --out FILE.gguf [--quant q8_0] [--no-check]
    localrl serve FILE.gguf [--host H] [--port P] [--api-key K] | localrl chat FILE.gguf|RUN_DIR|MODEL
    localrl tui [--attach RUN_DIR] [--model SOURCE] [--workdir DIR]
    localrl baselines pong [--quick] [--out DIR] [--steps N] [--seeds N] [--eval-points N]
    localrl plan --model M --group G --prompt-len P --completion-len R --budget 12GB
    localrl bench prompt-cache | grpo-step | export
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from localrl.config import FIELDS, build_config
from localrl.errors import UserError


def _add_config_flags(parser: argparse.ArgumentParser, only: list[str] | None = None) -> None:
    """One ``--field-name`` flag per config field; booleans also get ``--no-field-name``."""
    for name, f in FIELDS.items():
        if only is not None and name not in only:
            continue
        flags = ["--" + name.replace("_", "-")] + (["--4bit"] if name == "load_in_4bit" else [])
        kind = type(f.default)
        if kind is bool:
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=f.metadata["help"])
        else:
            parser.add_argument(*flags, dest=name, default=argparse.SUPPRESS, metavar=kind.__name__.upper(),
                                help=f"{f.metadata['help']} (default: {f.default!r})")


def _overrides(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k in FIELDS}


class ProgressBar:
    """A rich progress bar fed by metrics records: step, reward, accuracy, ETA."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeRemainingColumn(), transient=False)
        self.task = self.progress.add_task("train", total=total, stats="")
        self.total = total

    def __call__(self, record: dict) -> None:
        if record.get("kind") == "eval":
            self.progress.console.print(f"eval {record['when']}: {_eval_line(record)}")
            return
        if not self.progress.live.is_started:  # start the clock at the first step (after loading and eval)
            self.progress.start()
            self.progress.reset(self.task, completed=record["step"] - 1)
        kl = "" if record["kl"] is None else f"  kl {record['kl']:.4f}"
        stats = f"reward {record['reward_mean']:.3f}  acc {record['accuracy']:.1%}{kl}"
        self.progress.update(self.task, completed=record["step"], stats=stats)

    def close(self) -> None:
        self.progress.stop()


def _eval_line(r: dict) -> str:
    return f"accuracy {r['accuracy']:.1%}, mean reward {r['reward_mean']:.3f} ({r['n']} held-out, greedy)"


def cmd_train(args: argparse.Namespace) -> int:
    from localrl.trainer import resume_config, train

    if args.resume:
        cfg = resume_config(args.resume, _overrides(args))
    else:
        cfg = build_config(args.config, _overrides(args))
    bar = ProgressBar(cfg.steps)
    try:
        result = train(cfg, listeners=[bar], resume=bool(args.resume), log=bar.progress.console.print)
    finally:
        bar.close()
    print(f"run: {result.run_dir}  ({result.steps_done}/{cfg.steps} steps)")
    before, after = result.eval_before, result.eval_after
    if before and after:
        delta = 100 * (after["accuracy"] - before["accuracy"])
        print(f"held-out accuracy ({after['n']} problems, greedy pass@1): "
              f"before {before['accuracy']:.1%} -> after {after['accuracy']:.1%} ({delta:+.1f} points)")
    return 130 if result.interrupted else 0


def cmd_eval(args: argparse.Namespace) -> int:
    from localrl.evaluate import evaluate
    from localrl.modeling import load_adapter, load_base, load_config, load_tokenizer, pick_device
    from localrl.tasks import load_task
    from localrl.trainer import default_rewards, resume_config

    if args.run:
        from localrl.checkpoint import latest_checkpoint

        cfg = resume_config(args.run, _overrides(args))
        ckpt = latest_checkpoint(Path(args.run))
        if ckpt is None:
            raise UserError(f"run {args.run}: has no checkpoint to evaluate")
    else:
        cfg, ckpt = build_config(None, _overrides(args)), None
    rewards, weights = default_rewards(cfg)
    task = load_task(cfg.data, cfg.eval_data, cfg.eval_size)
    if not task.held_out:
        raise UserError(f"data {cfg.data}: no held-out rows to evaluate on")
    device = pick_device(cfg.device)
    if ckpt is not None:
        model, tok = load_adapter(cfg.model, ckpt, cfg.load_in_4bit, device)
    else:
        path, _ = load_config(cfg.model)
        model, tok = load_base(path, cfg.load_in_4bit, device), load_tokenizer(path)
    result = evaluate(model, tok, task.held_out, rewards, weights, cfg.max_new_tokens, cfg.eval_batch_size)
    what = f"{args.run} ({ckpt.name})" if ckpt else cfg.model
    print(json.dumps({"model": what, **result}) if args.json else f"{what}: {_eval_line(result)}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from models import ROOT, builtin_names

    if args.action == "list":
        for name in builtin_names():
            built = (ROOT / name / "config.json").is_file()
            print(f"{name}\t{ROOT / name}\t{'built' if built else 'not built'}")
        return 0
    from dataclasses import replace

    from models.recipe import RECIPES, pretrain

    if args.name not in RECIPES:
        raise UserError(f"model {args.name!r}: no recipe; built-in recipes: {', '.join(RECIPES)}")
    recipe = RECIPES[args.name]
    if args.seed is not None:
        recipe = replace(recipe, seed=args.seed)
    if args.steps is not None:
        recipe = replace(recipe, steps=args.steps)
    out = Path(args.out) if args.out else ROOT / args.name
    t0 = time.time()
    pretrain(out, recipe)
    print(f"wrote {out} in {time.time() - t0:.0f}s")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from localrl.bench import bench_export, bench_grpo_step, bench_prompt_cache
    from localrl.modeling import pick_device

    if args.what == "export":
        print("export benchmark: the built-in model to every quant type, validated in llama.cpp "
              "(export time includes loading the model)")
        rows = bench_export()
        if args.json:
            print(json.dumps(rows))
        return 0 if all(r["passed"] for r in rows) else 1

    if args.what == "grpo-step":
        print("grpo-step benchmark: localrl vs TRL GRPOTrainer, one prompt x G=8, P=1000, R=100, "
              "4-bit Qwen2-style model with LoRA, cpu")
        result = bench_grpo_step(steps=args.repeats)
        if args.json:
            print(json.dumps(result))
        return 0
    device = pick_device(args.device)
    print(f"prompt-cache benchmark: one GRPO group, forward+backward, 4-bit Qwen2-style model with LoRA, "
          f"{device.type}, median of {args.repeats}")
    rows = bench_prompt_cache(repeats=args.repeats, device=device.type)
    if args.json:
        print(json.dumps(rows))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from localrl.memory import parse_bytes, plan_step, read_shape

    if args.group < 2 or args.prompt_len < 1 or args.completion_len < 1 or args.prompts < 1:
        raise UserError("plan: need --group >= 2 and positive --prompts, --prompt-len and --completion-len")
    shape = read_shape(args.model)
    budget = parse_bytes(args.budget, "budget") if args.budget else None
    dtype_bytes = 2 if args.device == "cuda" else 4
    plan = plan_step(shape, args.prompts, args.group, args.prompt_len, args.completion_len, budget,
                     args.lora_rank, not args.no_4bit, dtype_bytes)
    print(f"{args.model}: {shape.layers} layers, hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads, "
          f"vocab {shape.vocab}; {args.prompts} prompt(s) x G={args.group}, P={args.prompt_len}, "
          f"R={args.completion_len}, {'bf16 (cuda)' if dtype_bytes == 2 else 'fp32 (cpu)'}")
    print(plan.describe())
    return 0 if plan.fits else 1


def cmd_export(args: argparse.Namespace) -> int:
    from quant.export import export

    result = export(args.source, args.out, args.quant, check=not args.no_check)
    if result.report is None:
        return 0
    print(result.report.describe())
    return 0 if result.report.passed else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from localrl.serve import serve

    serve(args.gguf, args.host, args.port, args.api_key, args.n_ctx)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from localrl.serve import chat

    chat(args.source, args.n_ctx, args.max_tokens, args.system, args.temperature)
    return 0


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


def cmd_tui(args: argparse.Namespace) -> int:
    from tui.app import run_tui

    run_tui(args.attach, args.model, args.workdir, args.runs_dir)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localrl", description="Local-first GRPO fine-tuning of small reasoning models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="fine-tune with GRPO (default: the built-in tiny model and task)")
    p.add_argument("--config", help="TOML file of config fields (top level or a [train] table)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    _add_config_flags(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="held-out greedy accuracy of a base model or a run's adapter")
    p.add_argument("run", nargs="?", help="run directory (its latest checkpoint); omit to evaluate --model")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    _add_config_flags(p, ["model", "data", "eval_data", "eval_size", "eval_batch_size", "reward",
                          "format_weight", "max_new_tokens", "load_in_4bit", "device"])
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="write a run (adapter merged onto its base) or a model to GGUF, then validate it")
    p.add_argument("source", help="run directory or model directory / built-in name")
    p.add_argument("--out", required=True, help="output .gguf file")
    p.add_argument("--quant", default="f16", help="f32, f16, bf16, q8_0, q4_0, q4_1, q5_0 or q5_1 (default f16)")
    p.add_argument("--no-check", action="store_true", help="skip the llama.cpp validation")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("serve", help="serve a GGUF over an OpenAI-compatible HTTP API (llama-cpp-python)")
    p.add_argument("gguf", help="model file (.gguf)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this bearer token")
    p.add_argument("--n-ctx", type=int, default=2048, help="context length")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("chat", help="streaming terminal chat with a GGUF, a run or a model")
    p.add_argument("source", help="model file (.gguf), run directory, model directory or built-in name")
    p.add_argument("--temperature", type=float, default=0.2, help="sampling temperature (0: greedy)")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--n-ctx", type=int, default=2048, help="context length")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("tui", help="terminal UI: train and watch runs, chat with a model, a terminal agent")
    p.add_argument("--attach", default=None, metavar="RUN_DIR", help="watch a run started elsewhere")
    p.add_argument("--model", default=None, help="chat model to load: FILE.gguf, run directory, model or built-in name")
    p.add_argument("--workdir", default=".", help="the agent's working directory")
    p.add_argument("--runs-dir", default="runs", help="where runs started from the UI go")
    p.set_defaults(func=cmd_tui)

    p = sub.add_parser("baselines", help="backprop-free agents against PPO, measured with confidence intervals")
    p.add_argument("env", choices=["pong"], help="environment")
    p.add_argument("--quick", action="store_true", help="a shorter run for laptops (under 10 minutes on 2 cores)")
    p.add_argument("--out", default="baselines-pong", help="folder for results.md, results.json, learning_curves.png")
    p.add_argument("--steps", type=int, default=None, help="training env steps per agent and seed")
    p.add_argument("--seeds", type=int, default=None, help="seeds per agent")
    p.add_argument("--eval-points", type=int, default=None, help="evaluation points per agent and seed")
    p.set_defaults(func=cmd_baselines)

    p = sub.add_parser("plan", help="predict a GRPO step's peak memory and choose micro-batches for a budget")
    p.add_argument("--model", default="tiny-arith", help="model directory, config.json, or built-in name")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--prompts", type=int, default=1, help="prompts per step")
    p.add_argument("--prompt-len", type=int, required=True, help="prompt tokens (P)")
    p.add_argument("--completion-len", type=int, required=True, help="completion tokens (R)")
    p.add_argument("--budget", default="", help="memory budget, for example 12GB (empty: no limit)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--no-4bit", action="store_true", help="plan for a full-precision base")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"], help="compute dtype: bf16 on cuda, fp32 on cpu")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("bench", help="benchmarks that print ratios measured side by side")
    p.add_argument("what", choices=["prompt-cache", "grpo-step", "export"])
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per variant (median reported)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("models", help="built-in tiny models")
    p.add_argument("action", choices=["build", "list"])
    p.add_argument("name", nargs="?", default="tiny-arith", help="built-in model name")
    p.add_argument("--out", help="output directory (default: the built-in location)")
    p.add_argument("--seed", type=int, help="override the recipe's seed")
    p.add_argument("--steps", type=int, help="override the recipe's pretraining steps")
    p.set_defaults(func=cmd_models)
    return parser


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging
    import warnings

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # optional-kernel notices on every import
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # per-retry network noise
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _quiet_libraries()
        return args.func(args)
    except UserError as e:
        print(f"localrl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("localrl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
