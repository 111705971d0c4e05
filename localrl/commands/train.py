"""``localrl train`` and ``localrl sft``: a config from TOML, flags or a run to resume, the run with a progress
display, the held-out result before and after."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from localrl.commands import config_fields, main_rank, plugins_help, quiet_libraries
from localrl.commands.progress import ProgressBar
from localrl.config_io import fields_help

if TYPE_CHECKING:
    from localrl.samplers import Measure


def add_parser(commands) -> None:
    """``localrl train`` and ``localrl sft``: both take every config field as a flag (``config_fields``)."""
    for name, does, func in (("train", "fine-tune with GRPO (default: the built-in tiny model and task)", cmd_train),
                             ("sft", "warm start an agent: fine-tune the adapter on the environment's expert "
                              "episodes (then: localrl train --init-adapter RUN_DIR)", cmd_sft)):
        epilog = (lambda: plugins_help() + "\nconfig fields, by group:\n" + fields_help(config_fields(None))) \
            if name == "train" else None
        p = commands.add_parser(name, help=does, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False, epilog_of=epilog,
                                usage=f"localrl {name} [--config FILE.toml] [--resume RUN_DIR] [--FIELD VALUE ...]",
                                epilog=None if epilog else "localrl train's config fields, with objective = sft, "
                                "env = shell and lr = 5e-4 unless set")
        p.add_argument("--config", help="TOML file of config fields (top level or a [train] table)")
        p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
        p.set_defaults(func=func)


def cmd_train(args: argparse.Namespace, overrides: dict) -> int:
    quiet_libraries()
    from localrl.training.loop import resume_config, train
    from localrl.training.settings import build_config

    if args.resume:
        cfg = resume_config(args.resume, overrides)
    else:
        cfg = build_config(args.config, overrides)
    from localrl.objectives import objective_for
    from localrl.samplers import sampler_for

    sampler = sampler_for(cfg)
    bar = ProgressBar(cfg.steps, objective_for(cfg).summary, sampler.eval_line)
    try:
        result = train(cfg, listeners=[bar], resume=bool(args.resume), log=bar.log)
    finally:
        bar.close()
    if not main_rank():  # under torchrun, rank 0 reports
        return 130 if result.interrupted else 0
    print(f"run: {result.run_dir}  ({result.steps_done}/{cfg.steps} steps)")
    if result.eval_before and result.eval_after:
        print(before_after_line(result.eval_before, result.eval_after, sampler.measure))
    return 130 if result.interrupted else 0


def before_after_line(before: dict, after: dict, measure: Measure) -> str:
    """The held-out result of a run, before -> after, named as its sampler's ``measure`` says; a resume with another
    --eval-size measured the two on different sets, so it says so and claims no difference."""
    what, items, how = measure.what, measure.items, measure.how
    if before["n"] == after["n"]:
        delta = 100 * (after["accuracy"] - before["accuracy"])
        return (f"held-out {what} ({after['n']} {items}, {how}): "
                f"before {before['accuracy']:.1%} -> after {after['accuracy']:.1%} ({delta:+.1f} points)")
    return (f"held-out {what} ({how}): before {before['accuracy']:.1%} on {before['n']} {items} -> after "
            f"{after['accuracy']:.1%} on {after['n']} {items} (different sets: not comparable; `localrl eval` "
            f"both on one set)")


def cmd_sft(args: argparse.Namespace, overrides: dict) -> int:
    return cmd_train(args, overrides if args.resume else {"objective": "sft", **overrides})
