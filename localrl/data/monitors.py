"""Reward-hacking monitors: what each step's record says about where the reward comes from.

A policy that games its reward shows it in a few numbers before it shows it in a held-out score (the
reward-hacking findings of the PPO, GRPO and DAPO papers and their follow-ups): the reward's mix shifts
to one component (a format or length term carrying the gain), the reward starts to track completion
length, and a verifier the policy never trains on stops agreeing with the trained reward. Per step
this module gives

- ``reward_shares``: each trained component's weighted mean as a share of the whole (absolute values,
  so a punishment counts for what it moves);
- ``length_correlation``: Pearson's r between completions' rewards and their token counts;
- ``HackingMonitor``: over the last ``window`` steps, a warning when the training reward rose while the
  check reward (a reward at weight 0: logged, never trained on) fell, each a trend whose least-squares
  slope is at least ``t_min`` standard errors from zero (a scale-free test: rewards of any range, and
  a plateau's noise stays quiet). It warns once when that starts, again only after it has stopped.

Deliberately simple: straight-line trends over a short window, no correction for testing every
step, and no automatic stopping: the run says so and goes on.
"""

from __future__ import annotations

import math
from collections import deque


def reward_shares(means: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Each weighted component's share of the absolute weighted total (components at weight 0 left out)."""
    parts = {name: weights[name] * m for name, m in means.items() if weights.get(name, 0) != 0}
    total = sum(abs(v) for v in parts.values())
    return {name: (abs(v) / total if total else 0.0) for name, v in parts.items()}


def length_correlation(rewards: list[float], lengths: list[float]) -> float | None:
    """Pearson's r of reward and completion length over a step's completions; None when either is constant."""
    n = len(rewards)
    if n < 2:
        return None
    mr, ml = sum(rewards) / n, sum(lengths) / n
    cov = sum((r - mr) * (x - ml) for r, x in zip(rewards, lengths))
    vr = sum((r - mr) ** 2 for r in rewards)
    vl = sum((x - ml) ** 2 for x in lengths)
    if vr <= 1e-12 or vl <= 1e-12:
        return None
    return max(-1.0, min(1.0, cov / math.sqrt(vr * vl)))  # (rounding can leave |r| a hair above 1)


def trend_t(values: list[float]) -> float:
    """The t statistic of the least-squares slope of ``values`` against 0, 1, 2, ... (0 for a flat line;
    +-inf for an exact non-flat one)."""
    n = len(values)
    xs = [i - (n - 1) / 2 for i in range(n)]
    sxx = sum(x * x for x in xs)
    mean = sum(values) / n
    slope = sum(x * v for x, v in zip(xs, values)) / sxx
    residual = sum((v - mean - slope * x) ** 2 for x, v in zip(xs, values))
    if n <= 2 or residual <= 1e-24 * max(1.0, sum(v * v for v in values)):
        return 0.0 if abs(slope) < 1e-12 else math.copysign(math.inf, slope)
    return slope / math.sqrt(residual / (n - 2) / sxx)


class HackingMonitor:
    """Watches (training reward, check reward) step by step; ``observe`` returns a warning's text when the
    two part ways over the window, else None."""

    def __init__(self, window: int = 6, t_min: float = 2.0):
        if window < 3:
            raise ValueError("window must be at least 3")
        self.window, self.t_min = window, t_min
        self.history: deque[tuple[float, float]] = deque(maxlen=window)
        self.firing = False

    def observe(self, reward: float, check: float | None, step: int | None = None) -> str | None:
        if check is None or not (math.isfinite(reward) and math.isfinite(check)):
            return None
        self.history.append((reward, check))
        if len(self.history) < self.window:
            return None
        rewards, checks = [r for r, _ in self.history], [c for _, c in self.history]
        diverging = trend_t(rewards) >= self.t_min and trend_t(checks) <= -self.t_min
        started = diverging and not self.firing
        self.firing = diverging
        if not started:
            return None
        where = f"over steps {step - self.window + 1}-{step}" if step is not None else f"over {self.window} steps"
        return (f"possible reward hacking: the training reward rose from {rewards[0]:.3g} to {rewards[-1]:.3g} "
                f"{where} while the check reward, which is never trained on, fell from {checks[0]:.3g} to "
                f"{checks[-1]:.3g}; look at sample completions (localrl eval RUN_DIR) before trusting the "
                f"training reward")


FLAT_STEPS_WARNING = 3  # consecutive steps without a learning signal before the run says so


def no_signal_message(record: dict, steps: int, temperature: float) -> tuple[str, str]:
    """(kind, text) when every group's completions scored alike for ``steps`` steps: a "note" when every
    completion solved its task (success: the data is learned), else a "warning" saying why nothing is learned."""
    reward, solved = record["reward_mean"], record.get("accuracy")
    if solved == 1:
        return "note", (f"every group solved for {steps} steps: the model has learned this data; consider harder "
                        f"data or stopping")
    if reward == 0 or solved == 0:
        cause = ("every completion failed: the model may never give an answer the reward can read "
                 "(check the answer format and system_prompt, the reward, and `localrl eval` samples), or the "
                 "task is too hard for it")
    else:
        cause = (f"each group's completions scored alike ({reward:.3g} on average, {solved:.0%} solved): some "
                 f"tasks are always solved and the others never; sampling may be too cold (temperature "
                 f"{temperature:g}) or the data too uneven for this model")
    if record["truncated"] > 0.5:
        cause += f"; {record['truncated']:.0%} of completions hit max_new_tokens, so raise it"
    return "warning", f"no learning signal for {steps} steps: {cause}"
