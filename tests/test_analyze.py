"""``localrl analyze``: ScaleRL's sigmoid fit recovers the parameters of a synthetic run, the CLI prints them
with intervals and draws one PNG for several runs, and bad input is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from localrl.cli import main
from localrl.config import TrainConfig
from localrl.evaluation.analyze import analyze_run, fit_sigmoid, sigmoid_curve
from localrl.runs import Run

TRUE = dict(r0=0.2, a=0.9, b=1.5, c_mid=6000.0)


def synthetic_run(path, steps: int = 40, noise: float = 0.005, seed: int = 0, planned: int = 60, **params):
    """A run directory whose step records follow the sigmoid in generated tokens (8 x 125 tokens a step)."""
    params = {**TRUE, **params}
    path.mkdir()
    run = Run(path)
    run.write_config(TrainConfig(steps=planned, prompts_per_step=2, group_size=4))
    rng = np.random.default_rng(seed)
    c = np.arange(1, steps + 1) * 1000.0
    y = sigmoid_curve(c, **params) + rng.normal(0, noise, steps)
    with run.metrics_path.open("w") as f:
        for i, value in enumerate(y):
            f.write(json.dumps({"kind": "train", "step": i + 1, "completions": 8, "completion_len": 125.0,
                                "reward_mean": float(value), "wall_time": 2.0 * (i + 1)}) + "\n")
    return path


def test_the_fit_recovers_known_parameters_within_5_percent(tmp_path):
    curve = analyze_run(synthetic_run(tmp_path / "run"), samples=50)
    for name, value in TRUE.items():
        assert getattr(curve.fit, name) == pytest.approx(value, rel=0.05), name
        lo, hi = curve.intervals[name]
        assert lo <= getattr(curve.fit, name) <= hi
    assert list(curve.compute[:3]) == [1000.0, 2000.0, 3000.0]  # completions x completion_len, cumulative
    # the configured end (60 steps) is extrapolated at the run's compute a step
    assert curve.compute_planned == pytest.approx(60_000.0)
    assert curve.predicted_end == pytest.approx(sigmoid_curve(60_000.0, **TRUE), abs=0.01)


def test_an_exact_curve_is_fitted_exactly():
    c = np.geomspace(100, 1e6, 30)
    fit = fit_sigmoid(c, sigmoid_curve(c, 0.05, 0.7, 0.8, 2e4))
    assert (fit.r0, fit.a, fit.b, fit.c_mid) == pytest.approx((0.05, 0.7, 0.8, 2e4), rel=1e-3)
    assert fit.rms < 1e-5


def test_analyze_compares_runs_in_one_png(tmp_path, capsys):
    fast = synthetic_run(tmp_path / "fast", c_mid=4000.0)
    slow = synthetic_run(tmp_path / "slow", a=0.7, c_mid=12000.0, seed=1)
    out = tmp_path / "curves.png"
    assert main(["analyze", str(fast), str(slow), "--out", str(out), "--samples", "20", "--json"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("A (asymptote)") == 2 and "predicted at the configured end (60 steps" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fits = {f["run"]: f for f in json.loads(printed.strip().splitlines()[-1])}
    assert fits["fast"]["c_mid"] == pytest.approx(4000.0, rel=0.05)
    assert fits["slow"]["a"] == pytest.approx(0.7, rel=0.05) and fits["slow"]["c_mid"] == pytest.approx(12000, rel=0.05)


def test_steps_and_seconds_are_compute_axes_too(tmp_path):
    run = synthetic_run(tmp_path / "run")
    by_steps = analyze_run(run, compute="steps", samples=10)
    by_seconds = analyze_run(run, compute="seconds", samples=10)
    assert by_steps.fit.c_mid == pytest.approx(6.0, rel=0.05)  # 1000 tokens a step
    assert by_seconds.fit.c_mid == pytest.approx(12.0, rel=0.05)  # 2 s a step


@pytest.mark.parametrize("argv, message", [
    (["--metric", "loss"], "its records have no 'loss'; numbers they have: completion_len, completions"),
    (["--samples", "3"], "--samples must be at least 10"),
])
def test_bad_analyze_input_is_one_line(tmp_path, capsys, argv, message):
    run = synthetic_run(tmp_path / "run")
    assert main(["analyze", str(run), "--out", str(tmp_path / "x.png"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.png").exists()


def test_a_run_too_short_to_fit_is_one_line(tmp_path, capsys):
    run = synthetic_run(tmp_path / "run", steps=3)
    assert main(["analyze", str(run), "--out", str(tmp_path / "x.png")]) == 2
    assert "3 training steps recorded; a curve needs at least 5" in capsys.readouterr().err


@pytest.mark.parametrize("values", ["early", "straight"])
def test_a_rise_that_has_not_bent_yet_gives_no_asymptote_and_no_warnings(tmp_path, capsys, values, recwarn):
    """An unfinished run (the start of its rise, or a straight line) fits any asymptote: it once printed
    A = -2.9e+63 among numpy overflow warnings. It says so in one line instead; the PNG goes into the run."""
    run = synthetic_run(tmp_path / "run", steps=8, c_mid=40000.0) if values == "early" else \
        synthetic_run(tmp_path / "run", steps=8, noise=0.0)
    if values == "straight":
        lines = Run(run).metrics_path.read_text().splitlines()
        Run(run).metrics_path.write_text("".join(json.dumps({**json.loads(line), "reward_mean": 0.2 + 0.05 * i}) + "\n"
                                                 for i, line in enumerate(lines)))
    assert main(["analyze", str(run), "--samples", "20"]) == 0
    out = capsys.readouterr()
    assert "has not reached the middle of its rise yet" in out.out and "A (asymptote)" not in out.out
    assert "e+" not in out.out and not out.err
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert (run / "scaling.png").read_bytes()[:4] == b"\x89PNG"


def test_the_learning_curve_shows_rewards_above_one_and_below_zero(tmp_path):
    """A format bonus lifts the mean reward above 1; the plot once cut the line at 1.02."""
    from localrl.evaluation.plot import plot_run, y_limits

    assert y_limits([0.2, 0.9]) == (0.0, pytest.approx(1.02))
    lo, hi = y_limits([0.4, 1.3])
    assert lo == 0.0 and hi > 1.3
    lo, hi = y_limits([-0.5, 0.2])
    assert lo < -0.5 and hi >= 1.0
    run = synthetic_run(tmp_path / "run", steps=6, a=1.3)
    lines = Run(run).metrics_path.read_text().splitlines()
    Run(run).metrics_path.write_text("".join(json.dumps({**json.loads(x), "accuracy": 0.5}) + "\n" for x in lines))
    assert plot_run(run, tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_the_bootstrap_reports_its_progress(tmp_path):
    """analyze once printed nothing for the 25-80 s its refits took."""
    seen = []
    analyze_run(synthetic_run(tmp_path / "run"), samples=12, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 12) for i in range(12)]
