"""Read a JSONL dataset of ``{"prompt": ..., "answer": ..., <extra columns>}`` rows, strictly.

The whole file is checked before training starts; the first bad line stops the run with
``file:line: what is wrong``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterator

from localrl.errors import UserError


def _check_prompt(prompt, where: str) -> None:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise UserError(f"{where}: 'prompt' is empty")
        return
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt):
        return
    raise UserError(f"{where}: 'prompt' must be a string or a list of {{role, content}} messages")


def json_objects(path: str | Path, what: str = "data") -> Iterator[tuple[str, dict]]:
    """``("file:line", object)`` for each non-empty line of a JSONL file; the first line that is not
    a UTF-8 JSON object stops with one line naming it."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} {p}: no such file" + (" (a directory)" if p.is_dir() else ""))
    try:
        data = p.read_bytes()
    except OSError as e:
        raise UserError(f"{what} {p}: cannot be read ({e.strerror})") from None
    found = False
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{p}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})") \
                from None
        if not line.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
        found = True
        yield where, row
    if not found:
        raise UserError(f"{what} {p}: no rows (the file is empty)")


def read_jsonl(path: str | Path, check_row: Callable[[dict, str], None] | None = None) -> list[dict]:
    """The rows of a JSONL file; ``check_row(row, "file:line")`` may refuse a row (UserError)."""
    rows = []
    for where, row in json_objects(path):
        for key in ("prompt", "answer"):
            if key not in row:
                raise UserError(f"{where}: missing '{key}'")
        _check_prompt(row["prompt"], where)
        if not isinstance(row["answer"], (str, int, float)) or isinstance(row["answer"], bool):
            raise UserError(f"{where}: 'answer' must be a string or a number")
        if isinstance(row["answer"], float) and not math.isfinite(row["answer"]):  # JSON's NaN and Infinity
            raise UserError(f"{where}: 'answer' must be a finite number (got {row['answer']})")
        if check_row is not None:
            check_row(row, where)
        rows.append(row)
    return rows
