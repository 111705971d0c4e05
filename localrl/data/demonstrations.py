"""Demonstrations: prompt-completion rows, as TRL's ``SFTTrainer`` takes them (its prompt-completion type).

A row is ``{"prompt", "completion"}``: standard (two strings) or conversational (the prompt a list of
``{role, content}`` messages, the completion a list holding one assistant message). Every row becomes
``{"prompt": str | messages, "completion": str}``, checked before any model loads; the first bad one stops the run
with one line naming its place (``file:line``). The rows are read from any source a task's are
(``localrl.data.sources``).
"""

from __future__ import annotations

from localrl.data.jsonl import check_prompt
from localrl.data.preferences import completion_text
from localrl.data.sources import Columns, raw_rows
from localrl.errors import UserError


def demonstration_row(raw: dict, where: str) -> dict:
    """A source's row as ``{"prompt", "completion"}`` (the completion's text), or one line naming ``where``."""
    for key in ("prompt", "completion"):
        if key not in raw:
            raise UserError(f"{where}: missing '{key}' (a demonstration is {{prompt, completion}}, TRL's "
                            f"prompt-completion type); columns: {', '.join(map(str, raw)) or 'none'}")
    check_prompt(raw["prompt"], where)
    return {"prompt": raw["prompt"], "completion": completion_text(raw["completion"], where, "completion")}


def read_demonstrations(source: str, what: str = "data") -> list[dict]:
    rows = [demonstration_row(raw, where) for where, raw in raw_rows(source, Columns(), what)]
    if not rows:
        raise UserError(f"{what} {source}: no rows", field=what)
    return rows
