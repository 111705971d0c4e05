"""The built-in verifiable task: multi-digit addition with a step-by-step scratchpad.

A problem is ``What is 457 + 68?``; a worked answer adds digit columns from the right,
one line per column, then states the sum:

    <think>7+8=15
    5+6+1=12
    4+0+1=5
    </think><answer>525</answer>

Traces can carry one realistic, systematic mistake: forgetting the carry. A column
that should read ``5+6+1=12`` is written ``5+6=11`` and the rest of the trace follows
from that slip, so the final answer is wrong but consistent with its working. The
built-in model is pretrained on traces that drop each carry with a fixed probability,
which leaves it only partly right and gives reinforcement learning a clear thing to fix.

Problems are split by a hash of the operands: held-out problems never appear in
pretraining or RL prompts, whatever the seed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from localrl.data.calibration import TRAILING_CONFIDENCE

MIN_DIGITS = 1
MAX_DIGITS = 4


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} + {self.b}?"

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def is_held_out(p: Problem) -> bool:
    """One problem in eight is reserved for evaluation, by a fixed hash of its operands."""
    return (p.a * 1_000_003 + p.b * 7919) % 8 == 0


def _random_operand(rng: random.Random) -> int:
    digits = rng.randint(MIN_DIGITS, MAX_DIGITS)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def sample_problems(rng: random.Random, n: int, held_out: bool = False) -> list[Problem]:
    """Draw ``n`` problems from the training split (or the held-out split)."""
    out: list[Problem] = []
    while len(out) < n:
        p = Problem(_random_operand(rng), _random_operand(rng))
        if is_held_out(p) == held_out:
            out.append(p)
    return out


def held_out_problems(n: int) -> list[Problem]:
    """The fixed evaluation set: ``n`` distinct problems, the same on every machine and every run."""
    rng, seen = random.Random(20_240_229), {}
    while len(seen) < n:
        for p in sample_problems(rng, n - len(seen), held_out=True):
            seen.setdefault(p, None)
    return list(seen)


def worked_answer(p: Problem, rng: random.Random | None = None, drop_carry: float = 0.0) -> str:
    """The scratchpad completion for ``p``; each carry is forgotten with probability ``drop_carry``."""
    xs, ys = str(p.a)[::-1], str(p.b)[::-1]
    lines, digits, carry = [], [], 0
    for i in range(max(len(xs), len(ys))):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        if carry and rng is not None and rng.random() < drop_carry:
            carry = 0  # the systematic slip: the carry is forgotten
        total = x + y + carry
        lines.append(f"{x}+{y}+{carry}={total}" if carry else f"{x}+{y}={total}")
        digits.append(str(total % 10))
        carry = total // 10
    if carry:
        digits.append("1")
    result = "".join(reversed(digits)).lstrip("0") or "0"
    return "<think>" + "\n".join(lines) + "\n</think><answer>" + result + "</answer>"


def slipped_answer(p: Problem) -> str:
    """A near miss of ``p``'s worked answer: every carry forgotten, or, with no carry to forget, one digit of the
    answer slipped (seeded by the problem)."""
    forgot = worked_answer(p, random.Random(0), drop_carry=1.0)
    if forgot != worked_answer(p):
        return forgot
    answer = p.answer
    rng = random.Random(f"slip/{p.a}/{p.b}")
    at = rng.randrange(len(answer))
    digit = rng.choice([d for d in "0123456789" if d != answer[at] and (d != "0" or at or len(answer) == 1)])
    return worked_answer(p).replace(f"<answer>{answer}<", f"<answer>{answer[:at]}{digit}{answer[at + 1:]}<")


def parse_question(text: str) -> Problem | None:
    """The problem a question asks (the first ``What is A + B?`` in ``text``), or None."""
    asked = _QUESTION.search(text)
    return Problem(int(asked.group(1)), int(asked.group(2))) if asked else None


_QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")
_STRICT_ANSWER = re.compile(r"<answer>\s*(\d+)\s*</answer>\s*" + TRAILING_CONFIDENCE + "$")


def addition_check(completions: list[str], prompt: list, **_) -> list[float]:
    """An independent verifier of the addition task, for the reward-hacking monitor (never trained on): it
    recomputes the sum from the question in the prompt (not from the answer column the training reward reads)
    and accepts only a completion that ends with that number alone in one pair of answer tags (a stated
    confidence may follow), so a
    completion the training reward pays for a number it merely mentions (the last number, when untagged)
    scores 0 here."""
    out = []
    for text, p in zip(completions, prompt):
        question = p if isinstance(p, str) else " ".join(m["content"] for m in p if m.get("role") == "user")
        asked = _QUESTION.search(question)
        given = _STRICT_ANSWER.search(text.strip())
        right = bool(asked and given and text.count("<answer>") == 1 and
                     int(given.group(1)) == int(asked.group(1)) + int(asked.group(2)))
        out.append(float(right))
    return out
