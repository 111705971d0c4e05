"""Scaling-curve fits of RL runs (ScaleRL: Khatri et al., "The Art of Scaling Reinforcement Learning
Compute for LLMs", 2025): a run's reward against the compute spent on it follows a sigmoid

    R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B)

with A the asymptote, B the exponent (how sharply it rises), C_mid the compute at which half of the
gain A - R0 is reached and R0 the reward at no compute. ``localrl analyze RUN_DIR ...`` fits it to each
run's per-step training records, prints the parameters with bootstrap intervals and the reward
the curve predicts at the run's configured end, and draws the data with the fitted curves (one PNG, every
run in it).

Deliberate simplifications: compute is counted in generated completion tokens (or steps, or wall-clock
seconds), not FLOPs; the per-step value is the sampled rollouts' mean (not a separate held-out set, as
ScaleRL measures), so it is noisy, which the intervals show; R0 is fitted with A (both enter linearly,
so for each (B, C_mid) they come from a least-squares solve; B and C_mid are searched on a grid and
refined by Nelder-Mead). Intervals are the 2.5% and 97.5% quantiles over bootstrap refits of resampled
steps (pairs bootstrap).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localrl.errors import UserError
from localrl.metrics import read_metrics
from localrl.runs import Run

COMPUTE = {"tokens": "generated tokens", "steps": "steps", "seconds": "wall-clock seconds"}
MIN_POINTS = 5  # four parameters: fewer steps than this cannot pin a curve down


def sigmoid_curve(c: np.ndarray, r0: float, a: float, b: float, c_mid: float) -> np.ndarray:
    """R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), for compute C > 0."""
    with np.errstate(over="ignore"):  # (C_mid / C)^B overflowing to inf is the curve's limit R0: exact
        return r0 + (a - r0) / (1.0 + (c_mid / np.asarray(c, dtype=float)) ** b)


@dataclass
class Fit:
    r0: float
    a: float
    b: float
    c_mid: float
    rms: float  # of the residuals

    def predict(self, c) -> np.ndarray:
        return sigmoid_curve(c, self.r0, self.a, self.b, self.c_mid)

    def pins_asymptote(self, c: np.ndarray) -> bool:
        """Whether the data reach the curve's midpoint: before it, a rise fits any asymptote (a straight line
        is the start of a sigmoid with A anywhere), and A is a guess, not a measurement."""
        return bool(np.isfinite(self.a) and self.c_mid <= float(np.max(c)))


def _linear_part(c: np.ndarray, y: np.ndarray, b: np.ndarray, c_mid: np.ndarray):
    """For arrays of (B, C_mid) [K]: the least-squares (R0, A) of each and its sum of squared residuals.
    y = R0 (1 - s) + A s with s = 1 / (1 + (C_mid / C)^B)."""
    with np.errstate(over="ignore"):  # far from C_mid the power overflows to inf and s is 0, as it should be
        s = 1.0 / (1.0 + (c_mid[:, None] / c[None, :]) ** b[:, None])  # [K, N]
    u = 1.0 - s
    # normal equations of the two-column design [u, s], solved in closed form per row
    suu, sss, sus = (u * u).sum(1), (s * s).sum(1), (u * s).sum(1)
    suy, ssy = (u * y).sum(1), (s * y).sum(1)
    det = suu * sss - sus * sus
    ok = det > 1e-12 * np.maximum(suu * sss, 1e-300)
    det = np.where(ok, det, 1.0)
    r0 = np.where(ok, (sss * suy - sus * ssy) / det, np.nan)
    a = np.where(ok, (suu * ssy - sus * suy) / det, np.nan)
    sse = ((r0[:, None] * u + a[:, None] * s - y) ** 2).sum(1)
    return r0, a, np.where(ok, sse, np.inf)


def _nelder_mead(f, x0: np.ndarray, step: np.ndarray, iters: int = 200) -> np.ndarray:
    """Minimise f from x0 (a small dimension): the textbook simplex method."""
    simplex = [x0] + [x0 + np.eye(len(x0))[i] * step[i] for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2.0 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best point
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


def fit_sigmoid(c, y) -> Fit:
    """The least-squares sigmoid through points (C, R), C > 0, its midpoint within a decade of the data."""
    c, y = np.asarray(c, dtype=float), np.asarray(y, dtype=float)
    lo, hi = np.log(c.min()), np.log(c.max())
    # a grid over log C_mid (a decade beyond the data each side) and log B, then a local refinement
    grid_c = np.linspace(lo - np.log(10), hi + np.log(10), 60)
    grid_b = np.linspace(np.log(0.1), np.log(20.0), 50)
    gc, gb = (g.ravel() for g in np.meshgrid(grid_c, grid_b))
    _, _, sse = _linear_part(c, y, np.exp(gb), np.exp(gc))
    best = int(np.argmin(sse))

    def objective(x: np.ndarray) -> float:
        return float(_linear_part(c, y, np.exp(x[1:2]), np.exp(x[0:1]))[2][0])

    box = np.array([[grid_c[0], grid_b[0]], [grid_c[-1], grid_b[-1]]])

    def bounded(x: np.ndarray) -> float:  # the refinement stays where the grid looked: beyond it A runs off
        return objective(x) if np.all((box[0] <= x) & (x <= box[1])) else np.inf

    x = _nelder_mead(bounded, np.array([gc[best], gb[best]]), np.array([0.2, 0.2]))
    r0, a, sse = _linear_part(c, y, np.exp(x[1:2]), np.exp(x[0:1]))
    return Fit(float(r0[0]), float(a[0]), float(np.exp(x[1])), float(np.exp(x[0])), float(np.sqrt(sse[0] / len(c))))


def bootstrap(c, y, samples: int = 200, seed: int = 0,
              progress: Callable[[int, int], None] | None = None) -> dict[str, tuple[float, float]]:
    """95% intervals of each parameter over refits of resampled points; ``progress(done, samples)`` after each."""
    c, y = np.asarray(c, dtype=float), np.asarray(y, dtype=float)
    rng = np.random.default_rng(seed)
    fits = []
    for i in range(samples):
        if progress is not None:
            progress(i, samples)
        idx = rng.integers(0, len(c), len(c))
        if len(np.unique(c[idx])) < MIN_POINTS - 1:
            continue
        fit = fit_sigmoid(c[idx], y[idx])
        if fit.pins_asymptote(c[idx]):  # a resample that ends before the midpoint measures nothing of A
            fits.append(fit)
    if not fits:
        return {name: (np.nan, np.nan) for name in ("r0", "a", "b", "c_mid")}
    out = {}
    for name in ("r0", "a", "b", "c_mid"):
        values = np.array([getattr(f, name) for f in fits])
        out[name] = (float(np.quantile(values, 0.025)), float(np.quantile(values, 0.975)))
    return out


@dataclass
class RunCurve:
    """One run's points, its fit and what the fit predicts."""

    name: str
    compute: np.ndarray  # cumulative, at the end of each step
    values: np.ndarray
    fit: Fit
    intervals: dict[str, tuple[float, float]]
    steps_done: int
    steps_planned: int
    compute_planned: float  # at the configured end, extrapolated at the run's mean compute a step
    predicted_end: float

    @property
    def fits(self) -> bool:
        """Whether the fit measures an asymptote (``Fit.pins_asymptote``)."""
        return self.fit.pins_asymptote(self.compute)


def run_points(run_dir: str | Path, metric: str = "reward_mean", compute: str = "tokens"):
    """(compute at the end of each step, the metric's value there, steps planned) of a run's train records."""
    run = Run.open(run_dir, "analyze")
    steps, completions = run.saved("steps"), run.saved("prompts_per_step") * run.saved("group_size")
    records = [r for r in read_metrics(run.metrics_path) if r.get("kind") == "train"]
    if len(records) < MIN_POINTS:
        raise UserError(f"analyze {run_dir}: {len(records)} training steps recorded; a curve needs at least "
                        f"{MIN_POINTS}")
    if metric not in records[0]:
        known = sorted(k for k, v in records[0].items() if isinstance(v, (int, float)) and k != "step")
        raise UserError(f"analyze {run_dir}: its records have no {metric!r}; numbers they have: {', '.join(known)}")
    if compute == "tokens":
        per_step = [r.get("completions", completions) *
                    r.get("completion_len", r.get("model_tokens", 0)) for r in records]
        c = np.cumsum(per_step, dtype=float)
    elif compute == "steps":
        c = np.array([r["step"] for r in records], dtype=float)
    else:
        c = np.array([r["wall_time"] for r in records], dtype=float)
    y = np.array([r[metric] for r in records], dtype=float)
    keep = np.isfinite(y) & (c > 0)
    return c[keep], y[keep], steps


def analyze_run(run_dir: str | Path, metric: str = "reward_mean", compute: str = "tokens",
                samples: int = 200, progress: Callable[[int, int], None] | None = None) -> RunCurve:
    """The run's fit; ``progress(done, samples)`` through the bootstrap refits (the slow part: seconds a run)."""
    c, y, planned = run_points(run_dir, metric, compute)
    with np.errstate(all="ignore"):  # a hopeless candidate curve overflows on the way; the fit says so itself
        fit = fit_sigmoid(c, y)
        intervals = bootstrap(c, y, samples, progress=progress) if fit.pins_asymptote(c) else {}
    per_step = c[-1] / len(c)
    end = per_step * planned if compute != "steps" else float(planned)
    return RunCurve(Path(run_dir).name, c, y, fit, intervals, len(c), planned, end, float(fit.predict([end])[0]))


def describe(curve: RunCurve, metric: str, compute: str) -> str:
    f, iv, unit = curve.fit, curve.intervals, COMPUTE[compute]
    if not curve.fits:
        return (f"{curve.name}: {curve.steps_done} steps; {metric} has not reached the middle of its rise yet "
                f"(last 5 steps: {np.mean(curve.values[-5:]):.4g}), so no asymptote can be estimated from it: "
                f"train longer, then analyze again")

    def row(label: str, value: float, key: str, fmt: str) -> str:
        lo, hi = iv[key]
        return f"  {label:<14} {value:{fmt}}  [{lo:{fmt}}, {hi:{fmt}}]"

    return "\n".join([
        f"{curve.name}: {curve.steps_done} steps, {curve.compute[-1]:,.0f} {unit}; {metric} against {unit}",
        row("A (asymptote)", f.a, "a", ".4g"),
        row("B (exponent)", f.b, "b", ".3g"),
        row("C_mid", f.c_mid, "c_mid", ",.4g"),
        row("R0", f.r0, "r0", ".4g") if f.c_mid >= curve.compute[0] else
        "  R0             not measured: the curve's midpoint lies before the first step",
        f"  residual rms   {f.rms:.4g}",
        f"  predicted at the configured end ({curve.steps_planned} steps, {curve.compute_planned:,.0f} {unit}): "
        f"{curve.predicted_end:.4g}" + ("" if curve.steps_done < curve.steps_planned else " (the run is complete)"),
    ])


def plot_curves(curves: list[RunCurve], out: str | Path, metric: str, compute: str) -> Path:
    """The runs' points and fitted curves in one PNG (written atomically)."""
    from localrl.evaluation.plot import pyplot, save_png

    fig, ax = pyplot().subplots(figsize=(7, 4), dpi=110)
    for i, curve in enumerate(curves):
        color = f"C{i}"
        ax.plot(curve.compute, curve.values, "o", ms=3, alpha=0.45, color=color,
                label=None if curve.fits else f"{curve.name}: no asymptote yet")
        if not curve.fits:
            continue
        grid = np.geomspace(curve.compute[0], max(curve.compute[-1], curve.compute_planned) * 3, 200)
        f = curve.fit
        ax.plot(grid, f.predict(grid), color=color,
                label=f"{curve.name}: A {f.a:.3g}, B {f.b:.3g}, C_mid {f.c_mid:,.3g}")
        ax.axhline(f.a, color=color, ls=":", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel(COMPUTE[compute] + " (log scale)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} against compute, sigmoid fits (ScaleRL)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return save_png(fig, out)
