"""A run's learning curve as a PNG: per-step reward and accuracy (success, for an agent) of the sampled
rollouts (for a warm start, the loss on the expert episodes), with the held-out greedy results before
and after training. ``localrl plot RUN_DIR``. What it draws is what the run's plug-ins say (``Curve``), never
guessed from the records."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

from localrl.errors import UserError
from localrl.metrics import read_metrics
from localrl.runs import Run


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, out: str | Path, **savefig) -> Path:
    """Render ``fig`` as a PNG, close it, and write it to ``out`` atomically; returns the path."""
    from localrl.atomic import write_bytes_atomic

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **savefig)
    pyplot().close(fig)
    write_bytes_atomic(Path(out), buffer.getvalue())
    return Path(out)


@dataclass(frozen=True)
class Curve:
    """What a run's learning curve draws, as its plug-ins declare it: the name of the held-out figure (its sampler's
    ``measure.what``) and whether its steps sample rollouts (its objective's ``samples``; else the step's loss)."""

    what: str = "accuracy"
    rollouts: bool = True


def plot_run(run_dir: str | Path, out: str | Path, title: str | None = None, curve: Curve = Curve()) -> Path:
    """Draw ``run_dir``'s metrics into ``out`` (written atomically) as ``curve`` says; returns the path."""
    plt = pyplot()
    run = Run.open(run_dir)
    records = read_metrics(run.metrics_path)
    steps = [r for r in records if r.get("kind") == "train"]
    if not steps:
        raise UserError(f"plot {run_dir}: no training steps recorded yet")
    evals = {r["when"]: r for r in records if r.get("kind") == "eval"}
    what = curve.what
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    x = [r["step"] for r in steps]
    handles = []
    if not curve.rollouts:  # no rollouts (a warm start): the loss on the expert episodes
        loss_ax = ax.twinx()
        handles += loss_ax.plot(x, [r["loss"] for r in steps], color="tab:red", label="loss on expert episodes")
        loss_ax.set_ylabel("loss (per agent token)")
        loss_ax.set_ylim(bottom=0)
    else:
        ax.plot(x, [r["accuracy"] for r in steps], color="tab:blue", alpha=0.5, label=f"rollout {what} (sampled)")
        ax.plot(x, _smooth([r["accuracy"] for r in steps]), color="tab:blue", label=f"rollout {what}, 5-step mean")
        ax.plot(x, [r["reward_mean"] for r in steps], color="tab:orange", alpha=0.6, label="mean reward")
    for when, marker, step in (("before", "o", 0), ("after", "s", x[-1])):
        if when in evals:
            r = evals[when]
            lo, hi = r.get("interval", (r["accuracy"], r["accuracy"]))
            ax.errorbar([step], [r["accuracy"]], yerr=[[r["accuracy"] - lo], [hi - r["accuracy"]]], fmt=marker,
                        color="black", capsize=4, label=f"held-out {what} {when} ({r['n']}, greedy): "
                                                       f"{r['accuracy']:.0%}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"{what} / reward")
    ax.set_ylim(*y_limits([r["reward_mean"] for r in steps if "reward_mean" in r]))
    ax.set_title(title or run.path.name)
    ax.grid(alpha=0.3)
    ax.legend(handles=ax.get_legend_handles_labels()[0] + handles, fontsize=7, loc="lower right")
    fig.tight_layout()
    out = Path(out)
    if out.is_dir() or not out.parent.is_dir():
        plt.close(fig)
        raise UserError(f"plot --out {out}: " + ("is a directory" if out.is_dir() else "its folder does not exist"))
    return save_png(fig, out)


def y_limits(rewards: list[float]) -> tuple[float, float]:
    """0 to 1 (rates), widened to every reward drawn: a format bonus can lift the mean reward above 1, a
    penalty below 0, and neither line may be cut off."""
    finite = [v for v in rewards if isinstance(v, (int, float)) and math.isfinite(v)]
    lo, hi = min([0.0, *finite]), max([1.0, *finite])
    pad = 0.02 * (hi - lo)
    return (lo - pad if lo < 0 else 0.0), hi + pad


def _smooth(values: list[float], k: int = 5) -> list[float]:
    return [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]


def plot_reliability(curves: dict[str, dict], out: str | Path, title: str = "reliability") -> Path:
    """A reliability diagram (accuracy against mean confidence per bin, the diagonal for perfect calibration,
    each curve's ECE in its label) of one or more ``calibration_summary`` results, written atomically."""
    fig, ax = pyplot().subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
    for name, summary in curves.items():
        filled = [b for b in summary["reliability"] if b["n"]]
        ax.plot([b["confidence"] for b in filled], [b["accuracy"] for b in filled], marker="o",
                label=f"{name} (ECE {summary['ece']:.3f}, n {sum(b['n'] for b in filled)})")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="stated confidence (bin mean)", ylabel="accuracy", title=title)
    ax.legend(loc="upper left", fontsize=8)
    return save_png(fig, out, dpi=100, bbox_inches="tight")
