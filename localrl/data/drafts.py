"""Draft refinement on the built-in addition task (``data = drafts``): each prompt carries a worked answer with one
mistake, and the model is to write the corrected answer.

    What is 457 + 68?
    Draft (one mistake):
    <think>7+8=15
    5+6=11
    4+0+1=5
    </think><answer>415</answer>
    Corrected:

Levels, each a kind of mistake a person or a model makes:

1. the working is right and the answer slipped one digit (copy the working's result);
2. one column's sum is off by one, and the working after it follows from the wrong sum (redo from that column);
3. a carry is forgotten (the built-in model's own slip), and the working after it follows (find the column).

The rewards that go with it: ``numeric`` scores the corrected answer (its accuracy is the fixed-draft rate), and
``draft_edits`` (``localrl.data.rewards``) takes off, from a right answer, the share of the draft's right lines the
completion changed, so a fix is paid more for keeping what was right: improve the draft, don't rewrite it from
scratch; and as a wrong answer pays nothing for its edits, copying the draft earns nothing either. A problem's
level and mistake are a pure function of the problem and its level, and the held-out split is the addition task's
(a held-out sum never appears as a training draft).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from localrl.data.arithmetic import Problem
from localrl.data.arithmetic import sample_problems as sample_sums

LEVELS = (1, 2, 3)
HEADER = "Draft (one mistake):"
FOOTER = "Corrected:"


def working(p: Problem, wrong_column: int = -1, off_by: int = 0, drop_carry_at: int = -1) -> tuple[list[str], str]:
    """(the column lines, the answer) of ``p``'s worked sum; ``wrong_column``'s sum off by ``off_by``, or the carry
    into column ``drop_carry_at`` forgotten, with everything after following from it."""
    xs, ys = str(p.a)[::-1], str(p.b)[::-1]
    lines, digits, carry = [], [], 0
    for i in range(max(len(xs), len(ys))):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        if i == drop_carry_at:
            carry = 0
        total = x + y + carry + (off_by if i == wrong_column else 0)
        lines.append(f"{x}+{y}+{carry}={total}" if carry else f"{x}+{y}={total}")
        digits.append(str(total % 10))
        carry = total // 10
    if carry:
        digits.append("1")
    return lines, "".join(reversed(digits)).lstrip("0") or "0"


def render(lines: list[str], answer: str) -> str:
    return "<think>" + "\n".join(lines) + "\n</think><answer>" + answer + "</answer>"


def carries(p: Problem) -> list[int]:
    """The columns a carry goes into."""
    lines, _ = working(p)
    return [i for i, line in enumerate(lines) if line.count("+") == 2]


@dataclass(frozen=True)
class DraftProblem:
    problem: Problem
    level: int

    @property
    def draft(self) -> str:
        p, rng = self.problem, random.Random(f"draft/{self.problem.a}/{self.problem.b}/{self.level}")
        lines, answer = working(p)
        if self.level == 1:
            at = rng.randrange(len(answer))
            digit = rng.choice([d for d in "0123456789" if d != answer[at] and (d != "0" or at or len(answer) == 1)])
            return render(lines, answer[:at] + digit + answer[at + 1:])
        if self.level == 2:
            column = rng.randrange(len(lines))
            off_by = rng.choice([-1, 1]) if int(lines[column].rsplit("=", 1)[1]) > 0 else 1
            return render(*working(p, wrong_column=column, off_by=off_by))
        return render(*working(p, drop_carry_at=rng.choice(carries(p))))

    @property
    def question(self) -> str:
        return f"{self.problem.question}\n{HEADER}\n{self.draft}\n{FOOTER}"

    @property
    def answer(self) -> str:
        return self.problem.answer

    @property
    def columns(self) -> dict:
        return {"draft": self.draft, "level": self.level}


def _draw(rng: random.Random, held_out: bool, levels: tuple[int, ...]) -> DraftProblem:
    while True:
        level = rng.choice(levels)
        p = sample_sums(rng, 1, held_out)[0]
        if level < 3 or carries(p):  # a forgotten carry needs one to forget
            return DraftProblem(p, level)


def sample_problems(rng: random.Random, n: int, held_out: bool = False,
                    levels: tuple[int, ...] = LEVELS) -> list[DraftProblem]:
    """``n`` drafts of the training split (or the held-out split), each of a level drawn from ``levels``."""
    return [_draw(rng, held_out, levels) for _ in range(n)]


def held_out_problems(n: int, levels: tuple[int, ...] = LEVELS) -> list[DraftProblem]:
    """The fixed evaluation set: ``n`` distinct drafts, the levels in turn, the same on every machine."""
    rng, seen = random.Random(20_261_203), {}
    while len(seen) < n:
        d = _draw(rng, True, (levels[len(seen) % len(levels)],))
        seen.setdefault(d, None)
    return list(seen)


def draft_lines(text: str) -> list[str]:
    """The column lines of a worked answer (inside its think tags), stripped."""
    inside = text.split("<think>", 1)[-1].split("</think>", 1)[0]
    return [line.strip() for line in inside.strip().splitlines() if line.strip()]
