"""Where prompts come from and how completions are scored: the prompt datasets (a config's ``task``: the
built-in addition and word problems, or a user's JSONL file) and the rewards that read them (``rewards``,
``calibration``).

A task hands out training rows for a step, deterministically from (seed, step), so a
resumed run sees exactly the batches an uninterrupted one would, and a fixed held-out
set for evaluation. A row is a dict with ``prompt`` (a string, or a list of chat
messages), ``answer``, and any extra columns, which reach the reward functions.

A task may carry a system prompt: the instruction stating the answer format the rewards
read (``FORMAT_PROMPT``), so that a real instruct model, which has never seen the
``<think>/<answer>`` format, knows it from the first step. It is given to the model,
never added to the rows, so rewards see the prompts as the data has them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from typing import Callable

from localrl.config import BUILTIN_TASKS
from localrl.data import arithmetic, drafts, word_problems
from localrl.data.calibration import CONFIDENCE_PROMPT
from localrl.data.sources import Columns, is_file_source, is_missing, read_rows
from localrl.errors import UserError
from localrl.models import builtin_path

Row = dict
RowCheck = Callable[[dict, str], None]
GENERATORS = {"arith": arithmetic, "words": word_problems, "drafts": drafts}  # name -> module with sample/held_out_problems
FORMAT_PROMPT = ("Think step by step inside <think> </think> tags, then give only the final answer inside "
                 "<answer> </answer> tags. For example: <think>3 + 4 = 7, and 7 x 2 = 14</think><answer>14</answer>")


@dataclass
class Task:
    name: str
    rows: list[Row] | None  # training rows of a file-backed task; None for a generated one
    held_out: list[Row]
    system: str | None = None  # the system prompt every prompt of this task is given, if any

    def sample(self, step: int, n: int, seed: int) -> list[Row]:
        """The ``n`` training rows of ``step``: a pure function of (seed, step)."""
        if self.rows is None:
            rng = random.Random(seed * 1_000_003 + step)
            return [_row(p) for p in GENERATORS[self.name].sample_problems(rng, n)]
        # Walk seeded per-epoch permutations of the file, so a step's rows need no saved state.
        out = []
        for i in range(step * n, step * n + n):
            epoch, k = divmod(i, len(self.rows))
            order = list(range(len(self.rows)))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            out.append(self.rows[order[k]])
        return out


    def resample(self, step: int, round: int, n: int, seed: int) -> list[Row]:
        """``n`` more training rows for ``step`` when dynamic sampling asks (``round`` 1, 2, ...): a pure
        function of (seed, step, round); generated problems are new ones, file rows drawn at random."""
        rng = random.Random(f"resample/{seed}/{step}/{round}")
        if self.rows is None:
            return [_row(p) for p in GENERATORS[self.name].sample_problems(rng, n)]
        return [self.rows[rng.randrange(len(self.rows))] for _ in range(n)]


def _row(problem) -> Row:
    return {"prompt": problem.question, "answer": problem.answer, **getattr(problem, "columns", {})}


def check_reward(setting: str, data: str):
    """The reward a run logs but never trains on (the config's ``check_reward``), or None: with "auto", the
    built-in addition task's independent verifier when training on that task; a name or module:function is
    resolved as any reward is."""
    if setting in ("", "none"):
        return None
    if setting == "auto":
        return arithmetic.addition_check if data in ("arith", "drafts") else None
    from localrl.data.rewards import resolve_reward

    return resolve_reward(setting)


def system_prompt(setting: str, model: str, confidence: bool = False) -> str | None:
    """The system message a run gives the model (the config's ``system_prompt``): with "auto", the
    answer-format instruction (with ``confidence``, a calibration run's, also the request to state a
    confidence after the answer), unless the model is a built-in one, which learned the format in
    pretraining and has never seen a system message."""
    if setting == "none":
        return None
    if setting == "auto":
        if builtin_path(model) is not None:
            return None
        return FORMAT_PROMPT + " " + CONFIDENCE_PROMPT if confidence else FORMAT_PROMPT
    return setting


def load_task(data: str, eval_data: str = "", eval_size: int = 200, check_row: RowCheck | None = None,
              system: str | None = None, columns: Columns = Columns()) -> Task:
    """Read and check a task's rows up front, before any model is loaded; ``check_row(row, where)``
    is called on every row with where it is (``file:line``, ``file:row N``, or the task's name) and may raise
    UserError. ``data`` is a built-in task, a file, a ``save_to_disk`` directory or a cached hub id
    (``localrl.data.sources``), its rows read through ``columns``; ``eval_data`` the same, for held-out rows."""
    held_source, held_columns = eval_data or data, replace(columns, split=columns.eval_split or columns.split)
    check_splits(data, eval_data, columns)
    held_out = (lambda: read_rows(held_source, held_columns, check_row, "eval_data")[:eval_size]) \
        if eval_data or columns.eval_split else None
    if data in GENERATORS:
        if held_out is not None:
            return Task(data, None, held_out(), system)
        held = [_row(p) for p in GENERATORS[data].held_out_problems(eval_size)]
        if check_row is not None:  # generated prompts differ only in names and digits: the longest stands for all
            sample = held + [_row(p) for p in GENERATORS[data].sample_problems(random.Random(0), 64)]
            check_row(max(sample, key=lambda r: len(r["prompt"])), f"task {data}")
        return Task(data, None, held, system)
    if is_missing(data):
        raise UserError(f"data {data!r}: no such file, and not a built-in task (built-in: {', '.join(BUILTIN_TASKS)})"
                        f" or a hub id (owner/name)", field="data")
    rows = read_rows(data, columns, check_row)
    if held_out is not None:
        return Task(data, rows, held_out(), system)
    held, train = held_out_split(rows, eval_size)
    return Task(data, train, held, system)


def check_splits(data: str, eval_data: str, columns: Columns) -> None:
    """A file or a built-in task has no configs or splits: a flag that names one is refused, not ignored (the
    held-out rows of a file's "test split" were its own rows, trained on too)."""
    def kind(source: str) -> str | None:
        return "a built-in task" if source in GENERATORS else "a file" if is_file_source(source) else None

    if kind(data) and columns.config:
        raise UserError(f"config field data_config: data {data} is {kind(data)}, which has no configs (a dataset's "
                        f"name, for a hub id or a save_to_disk directory)", field="data_config")
    if kind(data) and columns.split != "train":
        raise UserError(f"config field data_split: data {data} is {kind(data)}, which has no splits",
                        field="data_split")
    held, field = (eval_data, "eval_data") if eval_data else (data, "data")
    if kind(held) and columns.eval_split:
        raise UserError(f"config field eval_split: {field} {held} is {kind(held)}, which has no splits: give its "
                        f"held-out rows as --eval-data FILE, or leave eval_split empty (a seeded tenth of the rows "
                        f"held out, never trained on)", field="eval_split")


def shared_prompts(task: Task) -> int:
    """How many of ``task``'s held-out rows have a training row's prompt (a held-out file or split of the user's may
    repeat training rows; a seeded tenth of one source never does): what the run's first lines then say."""
    if task.rows is None:
        return 0
    trained = {json.dumps(r["prompt"], sort_keys=True) for r in task.rows}
    return sum(json.dumps(r["prompt"], sort_keys=True) in trained for r in task.held_out)


def held_out_split(rows: list, eval_size: int) -> tuple[list, list]:
    """(held out, train) of a source without a held-out file: a seeded tenth of ``rows`` (at most ``eval_size``) set
    aside, never trained on, and the rest."""
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    held = set(order[:min(eval_size, len(rows) // 10)])
    return [rows[i] for i in sorted(held)], [r for i, r in enumerate(rows) if i not in held]
