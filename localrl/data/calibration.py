"""Calibration: the confidence a completion states, the RLCR reward on it, and how well stated
confidences match outcomes (Brier score, expected calibration error, a reliability diagram).

RLCR (Damani et al., 2025, "Beyond Binary Rewards: Training LMs to Reason About Their
Uncertainty"): after its answer the model states how sure it is, a number q in [0, 1] inside
``<confidence>...</confidence>``, and is rewarded ``correct - (q - correct)^2``, its correctness
minus the Brier score of its confidence. The Brier score is a proper scoring rule: for an answer
that is right with probability p, the expected reward is highest at q = p, so the model gains
nothing by overstating, and the correctness term keeps it from trading accuracy for easy
confident answers. Here the Brier term is its own reward component (``calibration``,
``-(q - correct)^2``, weighted by the config's ``calibration_weight``; RLCR is weight 1) so the
reward shares show what it contributes. A completion that states no usable confidence scores the
worst Brier score, 1.

Expected calibration error over N answers with confidences: split [0, 1] into 10 equal bins,
ECE = sum over bins of (n_bin / N) |accuracy_bin - mean confidence_bin|, with q = 1.0 in the last
bin. Answers without a stated confidence are left out of ECE and Brier and counted apart
(``stated``, the share that stated one).
"""

from __future__ import annotations

import math
import re
from typing import Callable

CONFIDENCE_PROMPT = ("After the answer, say how likely it is to be right, as a number from 0 to 1 inside "
                     "<confidence> </confidence> tags, for example <confidence>0.8</confidence>.")
BINS = 10

TRAILING_CONFIDENCE = r"(?:<confidence>[^<]*</confidence>\s*)?"  # a pattern: the optional tag after an answer
_CONFIDENCE = re.compile(r"<confidence>(.*?)</confidence>", re.DOTALL)
_VALUE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(%?)\s*$")


def stated_confidence(text: str) -> float | None:
    """The confidence in a completion's last ``<confidence>`` tag: a number in [0, 1] (or a percentage,
    "80%"); None when there is no tag or it holds anything else."""
    found = _CONFIDENCE.findall(text)
    if not found:
        return None
    match = _VALUE.match(found[-1])
    if match is None:
        return None
    value = float(match.group(1)) / (100.0 if match.group(2) else 1.0)
    return value if 0.0 <= value <= 1.0 else None


class brier_penalty:
    """RLCR's calibration term as a reward: ``-(q - correct)^2`` for stated confidence q and the run's
    correctness reward (``correct``, 1 or 0); -1 where no confidence is stated."""

    __name__ = "calibration"

    def __init__(self, correct: Callable[..., list[float]]):
        self.correct = correct

    def __call__(self, completions: list[str], **columns) -> list[float]:
        right = self.correct(completions, **columns)
        out = []
        for text, ok in zip(completions, right):
            q = stated_confidence(text)
            out.append(-1.0 if q is None else -(q - float(ok == 1.0)) ** 2)
        return out


def brier_score(confidences: list[float], outcomes: list[float]) -> float:
    """Mean squared gap between each confidence and its outcome (1 right, 0 wrong)."""
    if not confidences:
        raise ValueError("brier_score: no confidences")
    return sum((q - y) ** 2 for q, y in zip(confidences, outcomes)) / len(confidences)


def _bin(q: float, bins: int) -> int:
    return min(int(math.floor(q * bins + 1e-9)), bins - 1)  # 1e-9: 0.3 * 10 lands in bin 3, not 2


def reliability(confidences: list[float], outcomes: list[float], bins: int = BINS) -> list[dict]:
    """Each equal-width bin's range, count, mean confidence and accuracy (None for an empty bin)."""
    members: list[list[int]] = [[] for _ in range(bins)]
    for i, q in enumerate(confidences):
        members[_bin(q, bins)].append(i)
    out = []
    for b, idx in enumerate(members):
        n = len(idx)
        out.append({"lo": b / bins, "hi": (b + 1) / bins, "n": n,
                    "confidence": sum(confidences[i] for i in idx) / n if n else None,
                    "accuracy": sum(outcomes[i] for i in idx) / n if n else None})
    return out


def expected_calibration_error(confidences: list[float], outcomes: list[float], bins: int = BINS) -> float:
    """ECE: the count-weighted mean over bins of |accuracy - mean confidence|."""
    if not confidences:
        raise ValueError("expected_calibration_error: no confidences")
    total = len(confidences)
    return sum(b["n"] / total * abs(b["accuracy"] - b["confidence"])
               for b in reliability(confidences, outcomes, bins) if b["n"])


def calibration_summary(completions: list[str], correct: list[float]) -> dict | None:
    """{"ece", "brier", "confidence_mean", "stated", "reliability"} over the completions that state a
    confidence (``correct``: 1 where right); None when none does."""
    pairs = [(q, float(ok == 1.0)) for q, ok in ((stated_confidence(t), ok) for t, ok in zip(completions, correct))
             if q is not None]
    if not pairs:
        return None
    qs, ys = [q for q, _ in pairs], [y for _, y in pairs]
    return {"ece": expected_calibration_error(qs, ys), "brier": brier_score(qs, ys),
            "confidence_mean": sum(qs) / len(qs), "stated": len(pairs) / len(completions),
            "reliability": reliability(qs, ys)}
