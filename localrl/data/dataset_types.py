"""TRL's dataset types, told apart by a source's columns as TRL tells them (its ``is_conversational`` and the
trainers' column checks): what a file of someone else's rows holds, before any sampler reads it.

==========================  =================================================  ==================================
type                        columns (each a string, or a conversation)          what takes it here
==========================  =================================================  ==================================
``prompt_only``             ``prompt`` (and localrl's ``answer`` for rewards)  sampling objectives (grpo, ...)
``prompt_completion``       ``prompt``, ``completion``                          ``localrl sft`` (demonstrations)
``preference``              ``chosen``, ``rejected`` (``prompt`` optional)      dpo (sampler preferences)
``unpaired_preference``     ``prompt``, ``completion``, ``label``               none (TRL's KTO)
``stepwise_supervision``    ``prompt``, ``completions``, ``labels``             none (TRL's PRM)
``language_modeling``       ``text`` or ``messages``                            none
==========================  =================================================  ==================================

localrl's own recorded agent sessions (``turns`` and ``messages``, ``localrl agent --record``) are ``sessions``:
preference pairs, as the preferences sampler reads them. A row with localrl's answer column is prompt-only
whatever else it holds (a ``completion`` beside it is a column the rewards see).
"""

from __future__ import annotations

from pathlib import Path

from localrl.agent.session_log import FILE as SESSIONS
from localrl.data.sources import Columns, raw_rows
from localrl.errors import UserError

# type -> the columns that make it, in TRL's words for the error lines
DESCRIBED = {
    "prompt_only": "prompt-only rows ({prompt})",
    "prompt_completion": "prompt-completion rows ({prompt, completion}: TRL's SFT data)",
    "preference": "preference pairs ({prompt, chosen, rejected}: TRL's DPO data)",
    "unpaired_preference": "unpaired preferences ({prompt, completion, label}: TRL's KTO data)",
    "stepwise_supervision": "stepwise supervision ({prompt, completions, labels}: TRL's PRM data)",
    "language_modeling": "language-modeling rows ({text} or {messages})",
    "sessions": "recorded agent sessions (localrl agent --record)",
}


def row_type(row: dict, columns: Columns = Columns()) -> str | None:
    """The dataset type of one row by its columns; None: no type TRL names (rows under other column names,
    read as the sampler's own ``--prompt-column`` and ``--answer-column`` say)."""
    keys = set(row)
    if {"turns", "messages"} <= keys:
        return "sessions"
    if {"chosen", "rejected"} <= keys:
        return "preference"
    if columns.answer in keys:
        return "prompt_only"
    if {"completion", "label"} <= keys:
        return "unpaired_preference"
    if {"completions", "labels"} <= keys:
        return "stepwise_supervision"
    if {columns.prompt, "completion"} <= keys:
        return "prompt_completion"
    if columns.prompt in keys:
        return "prompt_only"
    if keys & {"text", "messages"}:
        return "language_modeling"
    return None


_seen: dict[tuple, str | None] = {}


def source_type(source: str, columns: Columns = Columns(), what: str = "data") -> str | None:
    """The dataset type of ``source``'s first row (None: no rows, or none TRL names); a source that cannot be read
    is one line, as reading it would be. Remembered for the process (the config is checked more than once)."""
    path = Path(source)
    if (path / SESSIONS).is_file():  # a directory ``localrl agent --record`` wrote
        path = path / SESSIONS
        source = str(path)
    stamp = path.stat().st_mtime_ns if path.is_file() else None
    key = (source, columns, stamp)
    if key not in _seen:
        rows = raw_rows(source, columns, what)
        try:
            first = next(((where, row) for where, row in rows), None)
        finally:
            rows.close()
        _seen[key] = None if first is None else row_type(first[1], columns)
    return _seen[key]


def refuse(source: str, kind: str, takers: str, what: str = "data") -> UserError:
    """The one line for rows of ``kind`` given where they cannot be used; ``takers``: what can use them."""
    return UserError(f"{what} {source}: its rows are {DESCRIBED[kind]}; {takers}", field=what)
