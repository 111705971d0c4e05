"""JSONL read strictly: every line a UTF-8 JSON object, the first bad one stopping the run with ``file:line: what
is wrong`` (a task's rows: ``localrl.data.sources``; a shell environment's tasks: ``localrl.envs.shell_tasks``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from localrl.errors import UserError


# the roles chat templates know: OpenAI's (function: its older tool role) and Llama 3.1's tool role (ipython)
PROMPT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def check_prompt(prompt, where: str, column: str = "prompt") -> None:
    """A prompt is a non-empty string or a conversation (a non-empty list of {role, content} messages of the roles
    chat templates know, at least one of them the user's)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise UserError(f"{where}: '{column}' is empty")
        return
    if not (isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt)):
        raise UserError(f"{where}: '{column}' must be a string or a list of {{role, content}} messages")
    for i, m in enumerate(prompt):
        if m["role"] not in PROMPT_ROLES:
            raise UserError(f"{where}: '{column}' message {i}: role {m['role']!r} is none of {', '.join(PROMPT_ROLES)}")
    if not any(m["role"] == "user" for m in prompt):
        raise UserError(f"{where}: '{column}' has no user message (nothing is asked)")


def last_message(prompt) -> str:
    """A checked prompt's text: the string, or a conversation's last message's content (the question asked)."""
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


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
