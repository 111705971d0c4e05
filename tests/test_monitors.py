"""Reward-hacking monitors against hand-computed values: reward shares, the reward-length correlation, the
independent addition verifier, and a monitor that fires on a constructed log of reward hacking and stays
quiet on a healthy one."""

from __future__ import annotations

import math

import pytest

from localrl.data import check_reward
from localrl.data.arithmetic import addition_check
from localrl.data.monitors import HackingMonitor, length_correlation, reward_shares, trend_t


def test_reward_shares_are_absolute_weighted_shares_without_the_weight_0_check():
    means = {"numeric": 0.5, "format_reward": 0.8, "overlong": -0.2, "addition_check": 0.4}
    weights = {"numeric": 1.0, "format_reward": 0.1, "overlong": 1.0, "addition_check": 0.0}
    # weighted: 0.5, 0.08, -0.2 -> absolute total 0.78
    assert reward_shares(means, weights) == pytest.approx({"numeric": 0.5 / 0.78, "format_reward": 0.08 / 0.78,
                                                           "overlong": 0.2 / 0.78})
    assert reward_shares({"numeric": 0.0}, {"numeric": 1.0}) == {"numeric": 0.0}


def test_length_correlation_is_pearsons_r():
    assert length_correlation([0, 1, 0, 1], [10, 20, 10, 20]) == pytest.approx(1.0)
    assert length_correlation([1, 0, 1, 0], [10, 20, 10, 20]) == pytest.approx(-1.0)
    # r of (1,2,3,4) and (2,1,4,3): cov 3, variances 5 and 5 -> 0.6
    assert length_correlation([1, 2, 3, 4], [2, 1, 4, 3]) == pytest.approx(0.6)
    assert length_correlation([1, 1, 1], [3, 4, 5]) is None and length_correlation([1.0], [3]) is None


def test_the_addition_check_recomputes_the_sum_and_reads_only_a_clean_tagged_answer():
    prompts = ["What is 457 + 68?"] * 5 + [[{"role": "user", "content": "What is 2 + 2?"}]]
    completions = ["<think>7+8=15</think><answer>525</answer>",
                   "<think>...</think><answer>524</answer>",
                   "457 + 68 = 525",  # right by the lenient last-number reading, untagged: not here
                   "<answer>525</answer><answer>525</answer>",
                   "<answer>525</answer> and more text 1",
                   "<think>2+2=4</think><answer>4</answer>"]
    assert addition_check(completions, prompts, answer=["999"] * 6) == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert check_reward("auto", "arith") is addition_check
    assert check_reward("auto", "words") is None and check_reward("none", "arith") is None


def hacking_log(steps: int = 20, start: int = 8):
    """Training reward climbing all along; the check climbs with it, then falls from ``start`` on."""
    reward = [0.3 + 0.03 * s for s in range(steps)]
    check = [0.3 + 0.03 * s if s < start else 0.3 + 0.03 * start - 0.04 * (s - start) for s in range(steps)]
    return list(zip(reward, check))


def test_the_monitor_fires_once_when_the_rewards_part_ways():
    monitor = HackingMonitor(window=6)
    fired = [s + 1 for s, (r, c) in enumerate(hacking_log()) if monitor.observe(r, c, s + 1)]
    # steps 8-13 are the first window whose check values (0.51 0.54 0.50 0.46 0.42 0.38) trend down by more
    # than 2 standard errors; the windows after it go on falling: no second warning
    assert fired == [13]
    message = HackingMonitor(window=6)
    text = next(t for s, (r, c) in enumerate(hacking_log()) if (t := message.observe(r, c, s + 1)))
    assert "possible reward hacking" in text and "over steps 8-13" in text and "fell from 0.51 to 0.38" in text


def test_the_trend_statistic_is_the_slopes_t():
    # 1, 2, 4 at x = -1, 0, 1: slope 1.5, residuals 1/6, -1/3, 1/6, SE sqrt((1/6) / 1 / 2): t = 3 sqrt(3)
    assert trend_t([1, 2, 4]) == pytest.approx(3 * math.sqrt(3))
    assert trend_t([4, 2, 1]) == pytest.approx(-3 * math.sqrt(3))
    assert trend_t([1, 2, 3]) == math.inf and trend_t([2, 2, 2]) == 0.0


def test_the_monitor_stays_quiet_on_a_healthy_run_and_on_noise():
    import random

    rng = random.Random(0)
    healthy = [(0.3 + 0.03 * s + rng.gauss(0, 0.005), 0.25 + 0.025 * s + rng.gauss(0, 0.005)) for s in range(40)]
    plateau = [(0.9 + rng.gauss(0, 0.004), 0.85 + rng.gauss(0, 0.004)) for _ in range(40)]
    for log in (healthy, plateau):
        monitor = HackingMonitor(window=6)
        assert not any(monitor.observe(r, c, s + 1) for s, (r, c) in enumerate(log))
    monitor = HackingMonitor(window=6)
    assert not any(monitor.observe(r, None) for r in range(10))  # no check reward: nothing to compare
    assert monitor.observe(math.nan, 0.5) is None


@pytest.mark.slow
def test_a_run_logs_the_monitors_and_warns_when_a_gamed_reward_parts_from_the_check(builtin_model, tmp_path):
    """A reward that pays for length, not sums: the policy learns to ramble, its answers break, and the
    independent verifier (logged at weight 0) says so."""
    from localrl.metrics import read_metrics
    from localrl.runs import Run
    from localrl.training.loop import train
    from tests.helpers import QUIET, small

    cfg = small(tmp_path / "run", steps=12, reward="tests.helpers:longer_is_better", format_weight=0.0,
                hacking_window=4, lr=5e-3, rollout="torch")
    train(cfg, **QUIET)
    records = read_metrics(Run(tmp_path / "run").metrics_path)
    steps = [r for r in records if r["kind"] == "train"]
    assert all(set(r["rewards"]) == {"longer_is_better", "format_reward", "addition_check"} for r in steps)
    assert all(r["reward_shares"] == {"longer_is_better": 1.0} for r in steps)  # format at weight 0, check too
    assert all(r["reward_length_corr"] is None or -1 <= r["reward_length_corr"] <= 1 for r in steps)
    warnings = [r for r in records if r["kind"] == "warning" and "reward hacking" in r["message"]]
    assert warnings, [(r["reward_mean"], r["rewards"]["addition_check"]) for r in steps]
    first = warnings[0]["step"]  # its window: the training reward up, the verifier down
    window = steps[first - 4:first]
    assert window[-1]["reward_mean"] > window[0]["reward_mean"]
    assert window[-1]["rewards"]["addition_check"] < window[0]["rewards"]["addition_check"]
    assert max(r["completion_len"] for r in steps) > steps[0]["completion_len"]  # it learned to ramble
