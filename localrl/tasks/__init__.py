"""Where prompts come from: the built-in addition task or a user's JSONL file.

A task hands out training rows for a step, deterministically from (seed, step), so a
resumed run sees exactly the batches an uninterrupted one would, and a fixed held-out
set for evaluation. A row is a dict with ``prompt`` (a string, or a list of chat
messages), ``answer``, and any extra columns, which reach the reward functions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from localrl.config import BUILTIN_TASK
from localrl.errors import UserError
from localrl.tasks import arithmetic
from localrl.tasks.jsonl import read_jsonl

Row = dict
RowCheck = Callable[[dict, str], None]


@dataclass
class Task:
    name: str
    rows: list[Row] | None  # training rows of a file-backed task; None for a generated one
    held_out: list[Row]

    def sample(self, step: int, n: int, seed: int) -> list[Row]:
        """The ``n`` training rows of ``step``: a pure function of (seed, step)."""
        if self.rows is None:
            rng = random.Random(seed * 1_000_003 + step)
            return [{"prompt": p.question, "answer": p.answer} for p in arithmetic.sample_problems(rng, n)]
        # Walk seeded per-epoch permutations of the file, so a step's rows need no saved state.
        out = []
        for i in range(step * n, step * n + n):
            epoch, k = divmod(i, len(self.rows))
            order = list(range(len(self.rows)))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            out.append(self.rows[order[k]])
        return out


def load_task(data: str, eval_data: str = "", eval_size: int = 200, check_row: RowCheck | None = None) -> Task:
    """Read and check a task's rows up front, before any model is loaded; ``check_row(row, where)``
    is called on every row with its ``file:line`` (or the task's name) and may raise UserError."""
    if data == BUILTIN_TASK:
        if eval_data:
            return Task(data, None, read_jsonl(eval_data, check_row)[:eval_size])
        held = [{"prompt": p.question, "answer": p.answer} for p in arithmetic.held_out_problems(eval_size)]
        if check_row is not None:  # generated prompts differ only in their digits: the longest stands for all
            longest = max(held or [{"prompt": arithmetic.Problem(9999, 9999).question, "answer": 0}],
                          key=lambda r: len(r["prompt"]))
            check_row(longest, f"task {data}")
        return Task(data, None, held)
    if not Path(data).exists():
        raise UserError(f"data {data!r}: no such file, and not a built-in task (built-in: {BUILTIN_TASK})",
                        field="data")
    rows = read_jsonl(data, check_row)
    if eval_data:
        return Task(data, rows, read_jsonl(eval_data, check_row)[:eval_size])
    # No held-out file: set aside a seeded tenth of the rows (at most eval_size), never trained on.
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    n_eval = min(eval_size, len(rows) // 10)
    held = set(order[:n_eval])
    train = [r for i, r in enumerate(rows) if i not in held]
    return Task(data, train, [rows[i] for i in sorted(held)])
