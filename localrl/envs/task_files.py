"""A user's own shell tasks (``env_tasks``): a JSONL file of ``{"instruction", "files", "check"}`` lines, each
field checked with an error naming the file, the line and the field, or ``module:function`` returning
``ShellTask``s."""

from __future__ import annotations

import json
import math
from pathlib import Path

from localrl.data.jsonl import json_objects
from localrl.envs.shell_tasks import Check, ShellTask
from localrl.errors import UserError, failure_line, user_callable


def load_tasks(spec: str) -> list[ShellTask]:
    """A user's tasks: a JSONL file of ``{"instruction", "files", "check"}`` lines (see the README),
    or ``module:function`` naming a callable that returns a list of ``ShellTask``."""
    if spec.endswith(".jsonl"):
        return [_task_from_json(row, where) for where, row in json_objects(spec, "tasks")]
    _, sep, name = spec.partition(":")
    if not sep:
        raise UserError(f"tasks {spec!r}: expected a .jsonl file or module:function")
    make = user_callable(spec, "tasks", "env_tasks")
    try:
        tasks = list(make())
    except Exception as e:  # noqa: BLE001 - the user's function: its failure in one line
        raise UserError(f"tasks {spec}: calling {name}() failed: {failure_line(e)}", field="env_tasks") from None
    if not tasks or not all(isinstance(t, ShellTask) for t in tasks):
        raise UserError(f"tasks {spec}: must return a non-empty list of localrl.envs.shell_tasks.ShellTask",
                        field="env_tasks")
    return tasks


_TASK_FIELDS = ("instruction", "files", "check", "family", "level", "solution")
_CHECK_FIELDS = ("answer", "files", "absent", "dirs")


def _task_from_json(row: dict, where: str) -> ShellTask:
    """One line of a tasks file, checked field by field: ``file:line: field: what`` for the first wrong one."""
    unknown = set(row) - set(_TASK_FIELDS)
    if unknown:
        raise UserError(f"{where}: unknown field {sorted(unknown)[0]!r} (a task has {', '.join(_TASK_FIELDS)})")
    instruction = row.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise UserError(f"{where}: instruction: must be a non-empty string (got {_shown(instruction)})")
    files = _path_map(row.get("files", {}), where, "files")
    _no_file_inside_a_file(files, where)
    check = row.get("check")
    if not isinstance(check, dict) or not check or set(check) - set(_CHECK_FIELDS):
        raise UserError(f"{where}: check: must be an object with some of {', '.join(_CHECK_FIELDS)} "
                        f"(got {_shown(check)})")
    answer = check.get("answer")
    if answer is not None and (not isinstance(answer, (str, int, float)) or isinstance(answer, bool)
                               or isinstance(answer, float) and not math.isfinite(answer)):
        raise UserError(f"{where}: check.answer: must be a string or a finite number (got {_shown(answer)})")
    expected = _path_map(check.get("files", {}), where, "check.files")
    absent = _path_list(check.get("absent", []), where, "check.absent")
    dirs = _path_list(check.get("dirs", []), where, "check.dirs")
    family = row.get("family", "user")
    if not isinstance(family, str) or not family.strip():
        raise UserError(f"{where}: family: must be a non-empty string (got {_shown(family)})")
    level = row.get("level", 0)
    if not isinstance(level, int) or isinstance(level, bool) or level < 0:
        raise UserError(f"{where}: level: must be a whole number, 0 or more (got {_shown(level)})")
    solution = row.get("solution", [])
    if not isinstance(solution, list) or not all(isinstance(c, str) and c.strip() for c in solution):
        raise UserError(f"{where}: solution: must be a list of shell commands, each a non-empty string "
                        f"(got {_shown(solution)})")
    return ShellTask(instruction, files, Check(None if answer is None else str(answer), expected, absent, dirs),
                     family, level, tuple(solution))


def _shown(value) -> str:
    """A JSON value as an error shows it (shortened); a missing one as "nothing"."""
    if value is None:
        return "nothing"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _path_map(value, where: str, name: str) -> dict[str, str]:
    """A JSON object of relative path -> text content (``files``, ``check.files``)."""
    if not isinstance(value, dict):
        raise UserError(f"{where}: {name}: must be an object mapping relative paths to text contents "
                        f"(got {_shown(value)})")
    for path, content in value.items():
        _check_path(path, where, name)
        if not isinstance(content, str):
            raise UserError(f"{where}: {name}: the content of {path!r} must be a string (got {_shown(content)})")
    return dict(value)


def _path_list(value, where: str, name: str) -> tuple[str, ...]:
    """A JSON list of relative paths (``check.absent``, ``check.dirs``)."""
    if not isinstance(value, list):
        raise UserError(f"{where}: {name}: must be a list of relative paths (got {_shown(value)})")
    for path in value:
        _check_path(path, where, name)
    return tuple(value)


def _check_path(path, where: str, name: str) -> None:
    if not isinstance(path, str) or not _relative(path):
        raise UserError(f"{where}: {name}: path {path!r} must be relative and stay inside the working directory")


def _no_file_inside_a_file(files: dict[str, str], where: str) -> None:
    """Starting files that cannot all be made: ``a`` a file and ``a/b`` inside it, or one path twice."""
    seen: dict[tuple[str, ...], str] = {}
    for path in files:
        parts = Path(path).parts
        if parts in seen:
            raise UserError(f"{where}: files: {seen[parts]!r} and {path!r} are the same path")
        seen[parts] = path
    for path in files:
        if path.endswith("/"):
            continue  # an empty directory: others may be inside it
        parts = Path(path).parts
        for other in files:
            if other != path and Path(other).parts[:len(parts)] == parts:
                raise UserError(f"{where}: files: {path!r} is a file, so {other!r} cannot be inside it")


def _relative(path: str) -> bool:
    parts = Path(path).parts
    return bool(parts) and not Path(path).is_absolute() and ".." not in parts
