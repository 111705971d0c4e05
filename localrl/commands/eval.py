"""``localrl eval``: the held-out figures of a run's newest adapter or of a model, through the same sampler the
run's own evaluations use (``evaluate_policy``), printed with a few samples, a reliability diagram on request."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

from localrl.commands import check_png_path, config_fields, one_line, plugins_help, quiet_libraries
from localrl.commands.progress import ProgressBar
from localrl.config_io import fields_help
from localrl.errors import UserError


# the config fields `localrl eval` takes as flags (a run's own are read from it)
EVAL_FIELDS = ["model", "data", "eval_data", "data_config", "data_split", "eval_split", "prompt_column",
               "answer_column", "answer_format", "eval_size", "eval_batch_size", "reward", "reward_weights",
               "format_weight", "calibration_weight", "system_prompt", "max_new_tokens", "quantize", "device", "env",
               "env_tasks", "max_turns", "env_workers", "env_timeout", "isolation"]


def add_parser(commands) -> None:
    """``localrl eval``: its flags, and the config fields of EVAL_FIELDS as flags."""
    p = commands.add_parser("eval", help="held-out greedy accuracy of a base model or a run's adapter",
                            formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                            usage="localrl eval [RUN_DIR] [--json] [--FIELD VALUE ...]",
                            epilog_of=lambda: plugins_help() + "\nconfig fields (as in training; a run's own are "
                            "read from it):\n" + fields_help(config_fields(EVAL_FIELDS)))
    p.add_argument("run", nargs="?", help="run directory (its latest checkpoint); omit to evaluate --model")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--experience", metavar="RUN_DIR|FILE", help="give the model this experience library's lessons "
                   "(a training-free GRPO run, its experience.json, or a .txt of lessons, one a line); a run of "
                   "objective experience uses its own")
    p.add_argument("--reliability", metavar="PNG", help="draw the reliability diagram of the stated confidences "
                   "(<confidence> tags) into this PNG")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace, overrides: dict) -> int:
    quiet_libraries()
    from localrl.runs import Run
    from localrl.training.settings import build_config, read_run_config

    cfg = read_run_config(Run.open(args.run), overrides) if args.run else build_config(None, overrides)
    if args.reliability:
        check_png_path(args.reliability, "eval --reliability")
    bar = ProgressBar(0)

    def progress(done: int, total: int) -> None:
        bar({"kind": "status", "when": "held-out", "done": done, "total": total})

    try:
        result = evaluate_policy(cfg, args.run, progress=None if args.json else progress, experience=args.experience)
    finally:
        bar.close()
    if args.reliability and "ece" in result:
        from localrl.evaluation.plot import plot_reliability

        plot_reliability({result["model"]: result}, args.reliability, title=f"reliability: {result['model']}")
    if args.json:
        print(json.dumps(result))
        return 0
    from localrl.samplers import sampler_for

    sampler = sampler_for(cfg)
    print(f"{result['model']}: {sampler.eval_line(result)}")
    if args.reliability:
        print(f"wrote {args.reliability}" if "ece" in result else
              f"no completion stated a confidence: {args.reliability} not written")
    if "families" in result:
        items = sampler.measure.items
        for family, r in result["families"].items():
            print(f"  {family:<12} {r['success']:6.1%}  [95% CI {r['interval'][0]:.1%}, {r['interval'][1]:.1%}]  "
                  f"({r['n']} {items})")
        for i, sample in enumerate(result["samples"], 1):
            if "reply" in sample:  # a game's: the fixed first turn and the evaluated player's reply
                print(f"\n[{i}] {sample['family']}: {one_line(sample['turn'])}  (reward {sample['reward']:g})\n"
                      f"    reply: {one_line(sample['reply'])}")
                continue
            print(f"\n[{i}] {sample['family']} level {sample['level']}: {sample['task']}  (reward {sample['reward']:g})")
            for turn, observation in zip(sample["turns"], sample["observations"] + [""]):
                print(f"    agent: {one_line(turn)}")
                if observation:
                    print(f"    shell: {one_line(observation)}")
        return 0
    for i, sample in enumerate(result.get("samples", []), 1):  # what the rewards saw, so a score can be understood
        print(f"\n[{i}] prompt: {one_line(sample['prompt'])}\n    answer: {sample['answer']}"
              f"\n    completion: {one_line(sample['completion'])}\n    rewards: "
              + ", ".join(f"{name} {value:g}" for name, value in sample["rewards"].items()))
    return 0


def experience_of(run: str | Path | None, experience: str | Path | None = None):
    """The experience library to evaluate with: ``experience`` (a run directory, an experience.json or a
    .txt of lessons), else that of ``run`` when it is a training-free GRPO run, else None."""
    from localrl.policy.experience import load_library
    from localrl.runs import Run

    if experience:
        return load_library(experience)
    return load_library(run) if run is not None and Run(run).experience_path.is_file() else None


def evaluate_policy(cfg, run: str | Path | None = None,
                    progress: Callable[[int, int], None] | None = None, samples: int = 3,
                    experience: str | Path | None = None) -> dict:
    """Held-out figures of a run's newest adapter (``run``) or of ``cfg.model``, through the sampler ``cfg``
    selects, exactly as the run's own evaluations have them (the same decoding: Markovian traces, episodes in
    the environment, llama.cpp's greedy decoding of a run that sampled with it): {"model": what was
    evaluated, "accuracy", "reward_mean", "n", ..., "samples"}. A training-free GRPO run is evaluated with its
    experience library's lessons in the system message, and any model with ``experience``'s (a run
    directory, an experience.json or a .txt of lessons)."""
    from localrl.modeling import default_4bit, load_base, load_config, load_tokenizer, pick_device
    from localrl.runs import Run
    from localrl.samplers import ModelInfo, sampler_for
    from localrl.training.settings import check_config, read_run_config

    check_config(cfg)
    sampler = sampler_for(cfg)(cfg)
    if run is not None:  # an adapter is evaluated on what it was trained for, or the number means nothing
        trained = read_run_config(Run.open(run))
        was = sampler_for(trained)(trained)
        if (trained.env, type(was)) != (cfg.env, type(sampler)):
            raise UserError(f"eval {run}: the run was trained {was.describe_eval()}; evaluating it "
                            f"{sampler.describe_eval()} measures nothing it learned (leave --env and "
                            f"markovian_chunk as the run had them)", field="env")
    if cfg.env and experience:
        raise UserError("eval --experience: an experience library is for single-turn tasks (not env)")
    device = pick_device(cfg.device)
    path, config = load_config(cfg.model)
    tok = load_tokenizer(path)
    library = None if cfg.env else experience_of(run, experience)
    reserve = library.tokens(tok) if library is not None else 0  # the lessons lengthen every prompt
    plan = sampler.prepare(ModelInfo(path, config, tok, getattr(config, "max_position_embeddings", None), device)
                           if run is not None else None, reserve)
    sampler.require_held_out()
    in_4bit = default_4bit(cfg.quantize, device)
    if run is not None:
        model, tok, ckpt = Run.open(run).load_adapter(device, in_4bit, cfg)
        what = f"{run} ({ckpt.name})"
    else:
        model, what = load_base(path, in_4bit, device, cfg.compute_dtype), cfg.model
    if library is not None:  # a training-free GRPO run: the lessons it learned, as it gave them
        what += f" with the {len(library.lessons)} lessons of {experience or 'its experience library'}"
    if run is not None and plan.backend != "torch":  # as the run decoded: its sampler's backend
        sampler.start(model, tok, None)
    try:
        result = sampler.evaluate(model, tok, progress, cfg.eval_batch_size,
                                  library.system if library is not None else (lambda s: s), samples)
    finally:
        sampler.close()
    return {"model": what, **result}
