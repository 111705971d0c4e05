"""``localrl models list | build NAME | shape NAME``: the built-in models and the random-weight shapes."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from localrl.commands import replaceable_dir
from localrl.errors import UserError


def add_parser(commands) -> None:
    """``localrl models``: its flags."""
    p = commands.add_parser("models", help="built-in tiny models; random-weight models in published shapes")
    p.add_argument("action", choices=["build", "list", "shape"],
                   help="build a built-in model, list them, or write a random-weight model of a published shape")
    p.add_argument("name", nargs="?", default="tiny-arith", help="built-in model name, or a shape (models list)")
    p.add_argument("--out", help="output directory (build: default the built-in location; shape: required)")
    p.add_argument("--tokenizer", help="shape: a model directory or tokenizer.json to copy the tokenizer from "
                   "(default: the built-in one)")
    p.add_argument("--seed", type=int, help="override the pretraining seed (shape: the weights' seed, default 0)")
    p.add_argument("--steps", type=int, help="override the pretraining steps")
    p.set_defaults(func=cmd_models)


def cmd_models(args: argparse.Namespace) -> int:
    from localrl.models import ROOT, builtin_names

    if args.seed is not None and not 0 <= args.seed < 2**64:  # (torch takes -1 as 2**64 - 1: two names, one seed)
        raise UserError(f"models {args.action} --seed: must be from 0 to 2**64 - 1 (got {args.seed})")

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

    from localrl.models.build import PRETRAINING, build

    if args.name not in PRETRAINING:
        raise UserError(f"model {args.name!r}: not a built-in model; built-in: {', '.join(PRETRAINING)}")
    spec = PRETRAINING[args.name]
    if args.seed is not None:
        spec = replace(spec, seed=args.seed)
    if args.steps is not None:
        if args.steps < 1:
            raise UserError(f"models build --steps: must be at least 1 (got {args.steps})")
        spec = replace(spec, steps=args.steps)
    out = replaceable_dir(Path(args.out) if args.out else ROOT / args.name, "models build",
                          ("pretraining.json", "recipe.json"), "a built model")  # recipe.json: built by an earlier localrl
    t0 = time.time()
    build(out, spec)
    print(f"wrote {out} in {time.time() - t0:.0f}s")
    return 0


def _models_shape(args: argparse.Namespace) -> int:
    from localrl.models.shapes import find_shape, shape_names, write_shape

    if args.name == "tiny-arith":  # the positional's default: a shape must be named
        raise UserError(f"models shape: name a shape ({', '.join(shape_names())})")
    find_shape(args.name)
    if not args.out:
        raise UserError("models shape: --out DIR is required (where the model directory is written)")
    out = replaceable_dir(Path(args.out), "models shape", ("shape.json",), "a shape model")
    t0 = time.time()
    write_shape(args.name, out, args.tokenizer, args.seed or 0)
    print(f"wrote {out} in {time.time() - t0:.0f}s")
    return 0
