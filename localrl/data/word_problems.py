"""The built-in word-problem task: short everyday stories with one or two arithmetic steps.

    Mia has 23 stickers. She buys 9 more. How many stickers does Mia have now?   -> 32

Problems are generated from templates and seeded: a problem is a pure function of its
(template, names, numbers), the answer is computed, never written by hand, so every answer is
right. As in the addition task, one problem in eight (by a fixed hash) is held out from
training whatever the seed. The numbers stay small (answers below 1,000): these are for
small instruct models, which get the reading right before the arithmetic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = ["Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Lina", "Ravi", "Sara", "Tom", "Yuki", "Ines"]
ITEMS = ["apples", "stickers", "marbles", "books", "pencils", "cookies", "stamps", "shells", "cards", "coins"]


@dataclass(frozen=True)
class WordProblem:
    template: int
    name: str
    item: str
    numbers: tuple[int, ...]

    @property
    def question(self) -> str:
        n, item, (a, b, *rest) = self.name, self.item, self.numbers
        return [
            f"{n} has {a} {item}. {n} gets {b} more. How many {item} does {n} have now?",
            f"{n} had {a} {item} and gave {b} of them to a friend. How many {item} does {n} have left?",
            f"A box holds {a} {item}. How many {item} are there in {b} boxes?",
            f"{n} shares {a * b} {item} equally among {b} friends. How many {item} does each friend get?",
            f"{n} buys {a} packs of {b} {item} and gives away {rest[0] if rest else 0}. "
            f"How many {item} does {n} keep?",
            f"{n} has {a} {item}, finds {b} more, then loses {rest[0] if rest else 0}. "
            f"How many {item} does {n} have?",
        ][self.template]

    @property
    def answer(self) -> str:
        a, b, *rest = self.numbers
        c = rest[0] if rest else 0
        return str([a + b, a - b, a * b, a, a * b - c, a + b - c][self.template])


TEMPLATES = 6


def _numbers(template: int, rng: random.Random) -> tuple[int, ...]:
    if template == 0:
        return rng.randint(2, 500), rng.randint(2, 400)
    if template == 1:
        a = rng.randint(5, 900)
        return a, rng.randint(1, a - 1)
    if template in (2, 3):
        return rng.randint(2, 30), rng.randint(2, 12)
    if template == 4:
        a, b = rng.randint(2, 20), rng.randint(2, 12)
        return a, b, rng.randint(1, a * b - 1)
    a, b = rng.randint(2, 400), rng.randint(2, 300)
    return a, b, rng.randint(1, a + b - 1)


def is_held_out(p: WordProblem) -> bool:
    """One problem in eight is reserved for evaluation, by a fixed hash of its numbers and template."""
    h = p.template * 7919
    for x in p.numbers:
        h = h * 1_000_003 + x
    return h % 8 == 0


def sample_problems(rng: random.Random, n: int, held_out: bool = False) -> list[WordProblem]:
    out: list[WordProblem] = []
    while len(out) < n:
        template = rng.randrange(TEMPLATES)
        p = WordProblem(template, rng.choice(NAMES), rng.choice(ITEMS), _numbers(template, rng))
        if is_held_out(p) == held_out:
            out.append(p)
    return out


def held_out_problems(n: int) -> list[WordProblem]:
    """The fixed evaluation set: ``n`` distinct problems, the same on every machine and every run."""
    rng, seen = random.Random(20_261_130), {}
    while len(seen) < n:
        for p in sample_problems(rng, n - len(seen), held_out=True):
            seen.setdefault(p, None)
    return list(seen)
