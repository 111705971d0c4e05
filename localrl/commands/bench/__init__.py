"""``localrl bench NAME``: benchmarks that print ratios measured side by side. One module a benchmark, each
declaring its own flags (its ``add_parser``: a flag another benchmark takes is an unknown flag here, named by
argparse) and checking their values before anything runs (its ``run``); the work itself is in
``localrl.benchmarks`` and ``localrl.evaluation``."""

from __future__ import annotations

import argparse
import importlib
import json

BENCHMARKS = ("prompt_cache", "grpo_step", "export", "rollout", "agent_step", "distributed", "memory", "approvals",
              "world_model", "utilisation")  # modules of this package, in the order `localrl bench -h` lists them


def add_parser(commands) -> None:
    """``localrl bench`` and its benchmarks, each a subcommand of its own."""
    p = commands.add_parser("bench", help="benchmarks that print ratios measured side by side")
    benches = p.add_subparsers(dest="what", required=True, metavar="NAME", parser_class=type(p))
    for name in BENCHMARKS:
        importlib.import_module(f"{__name__}.{name}").add_parser(benches)


# -- flags several benchmarks take, each with its own default -------------------------------------------------------

def json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="also print the results as JSON")


def repeats_flag(p: argparse.ArgumentParser, what: str = "timed repetitions per variant (median reported)") -> None:
    p.add_argument("--repeats", type=int, default=3, metavar="N", help=f"{what}; default 3")


def size_flags(p: argparse.ArgumentParser, **defaults: str) -> None:
    """The step's sizes a benchmark takes (``prompts``, ``group``, ``prompt_len``, ``completion_len``), each
    with the words of its default; left out, a size is None (the benchmark's default)."""
    words = {"prompts": "prompts a step", "group": "completions per prompt G",
             "prompt_len": "prompt tokens P", "completion_len": "completion tokens R"}
    for name, default in defaults.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, metavar="N", help=f"{words[name]} (default {default})")


def sizes(args: argparse.Namespace, **defaults: int) -> tuple[int, ...]:
    """The sizes ``defaults`` names, as the flags give them or else their defaults (a 0 given stays 0, for the
    benchmark's own checks)."""
    return tuple(default if (v := getattr(args, name)) is None else v for name, default in defaults.items())


def model_size_flag(p: argparse.ArgumentParser, tiny: str) -> None:
    p.add_argument("--model-size", default="full", choices=["full", "tiny"],
                   help=f"the benchmark's model, or {tiny} (a smoke test)")


def qwen2_model(model_size: str) -> str:
    """How prompt-cache and grpo-step name the model they time."""
    return "4-bit Qwen2-style model" + (" (tiny, smoke test)" if model_size == "tiny" else "")


def check_model(name: str, shapes: bool = False, runs: bool = False) -> None:
    """A benchmark's model is there (a built-in name, a directory, a GGUF; with ``shapes`` a published shape's name,
    with ``runs`` a run directory), or one line, before its banner and before anything loads."""
    from localrl.modeling import check_source
    from localrl.runs import is_run

    if shapes:
        from localrl.models.shapes import SHAPES

        if name.lower() in SHAPES:
            return
    if not (runs and is_run(name)):
        check_source(name)


def print_json(args: argparse.Namespace, result) -> None:
    if args.json:
        print(json.dumps(result))
