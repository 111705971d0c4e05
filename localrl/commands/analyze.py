"""``localrl plot`` and ``localrl analyze``: a run's learning curve, and ScaleRL's fit of reward against compute
for one or more runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from localrl.commands import check_png_path
from localrl.commands.progress import ProgressBar
from localrl.errors import UserError


def add_parser(commands) -> None:
    """``localrl plot`` and ``localrl analyze``: their flags."""
    p = commands.add_parser("plot", help="a run's learning curve as a PNG (reward and accuracy per step, held-out "
                            "before and after)")
    p.add_argument("run", help="run directory")
    p.add_argument("--out", default=None, help="PNG file (default: RUN_DIR/learning_curve.png)")
    p.add_argument("--title", default=None, help="the chart's title (default: the run directory's name)")
    p.set_defaults(func=cmd_plot)

    p = commands.add_parser("analyze", help="fit ScaleRL's sigmoid (reward against compute) to runs: asymptote, "
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


def cmd_plot(args: argparse.Namespace) -> int:
    from localrl.evaluation.plot import Curve, plot_run
    from localrl.objectives import objectives
    from localrl.runs import Run
    from localrl.samplers import sampler_for
    from localrl.training.settings import read_run_config

    run = Run.open(args.run)
    cfg = read_run_config(run)
    curve = Curve(sampler_for(cfg).measure.what, objectives.get(cfg.objective).samples)
    out = plot_run(args.run, args.out or run.learning_curve_path, args.title, curve)
    print(f"wrote {out}")
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from localrl.evaluation.analyze import analyze_run, describe, plot_curves

    if not 10 <= args.samples <= 100_000:
        raise UserError(f"analyze: --samples must be at {'least 10' if args.samples < 10 else 'most 100,000'} "
                        f"(got {args.samples})")
    out = args.out or str(Path(args.runs[0]) / "scaling.png")  # beside the run's other plots, as `plot` writes
    check_png_path(out, "analyze --out")  # before the fits, not after them
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
