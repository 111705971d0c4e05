"""A user's rows, from wherever TRL's users keep them: a JSONL, Parquet, CSV, JSON or Arrow file, a directory
``datasets.save_to_disk`` wrote, or a Hugging Face hub id already in the local ``datasets`` cache (read offline:
nothing is downloaded).

Each row becomes ``{"prompt": ..., "answer": ..., <every other column>}``: the prompt from ``prompt_column``
(a string, or a conversation: a list of ``{role, content}`` messages), the answer from ``answer_column``,
optionally cut by an answer format (``gsm8k``: what follows ``####``; ``last-number``: the last number in it;
``regex:PATTERN``: the pattern's first group, else its whole match). The other columns reach the reward
functions, as TRL passes them. Every row is checked before any model loads; the first bad one stops the run
with one line naming the source and the row (``file:line`` for JSONL, ``file:row N`` otherwise).
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import regex

from localrl.config import BUILTIN_TASKS
from localrl.data.jsonl import check_prompt, json_objects
from localrl.errors import UserError, first_line

FILE_FORMATS = (".jsonl", ".parquet", ".csv", ".json", ".arrow")
ANSWER_FORMATS = ("", "gsm8k", "last-number")  # or "regex:PATTERN"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class Columns:
    """How rows are read from a source: its columns, the answer's format, and for a dataset its config and split."""

    prompt: str = "prompt"
    answer: str = "answer"
    answer_format: str = ""
    config: str = ""
    split: str = "train"
    eval_split: str = ""  # held-out rows from this split (empty: none named)

    @classmethod
    def of(cls, cfg) -> "Columns":
        return cls(cfg.prompt_column, cfg.answer_column, cfg.answer_format, cfg.data_config, cfg.data_split,
                   cfg.eval_split)


USER_REGEX_SECONDS = 1.0  # a user's pattern on one text: catastrophic backtracking stops here, in one line


def check_answer_format(fmt: str) -> str | None:
    """Why ``fmt`` is not an answer format (None when it is one)."""
    if fmt in ANSWER_FORMATS:
        return None
    if fmt.startswith("regex:"):
        try:
            regex.compile(fmt.removeprefix("regex:"))
        except regex.error as e:
            return f"regex {fmt.removeprefix('regex:')!r} does not compile ({e})"
        return None
    return "must be empty (the answer as it is), gsm8k, last-number or regex:PATTERN"


def extract_answer(text: str, fmt: str) -> str | None:
    """The answer ``fmt`` reads from ``text`` (None when it finds none)."""
    if not fmt:
        return text
    if fmt == "gsm8k":
        _, sep, after = text.rpartition("####")
        return (after.strip().replace(",", "") or None) if sep else None
    if fmt == "last-number":
        found = _NUMBER.findall(text)
        return found[-1].replace(",", "") if found else None
    pattern = fmt.removeprefix("regex:")
    try:  # (the regex module: Python's re has no time limit)
        match = regex.search(pattern, text, timeout=USER_REGEX_SECONDS)
    except TimeoutError:
        raise UserError(f"answer format regex:{pattern}: took over {USER_REGEX_SECONDS:g} s on one answer of "
                        f"{len(text)} characters (nested repeats backtrack without end); simplify the pattern",
                        field="answer_format") from None
    if match is None:
        return None
    found = match.group(1) if match.groups() else match.group(0)
    # (an optional group that did not take part, or a match of nothing, as `(\d*)` makes of any text: none)
    return (found.strip() or None) if found is not None else None


def is_file_source(data: str) -> bool:
    return Path(data).suffix.lower() in FILE_FORMATS


def is_missing(source: str) -> bool:
    """Whether ``source`` is neither a file or directory here nor a hub id (owner/name) the cache may hold."""
    return not Path(source).exists() and (is_file_source(source) or source.count("/") != 1)


def read_rows(source: str, columns: Columns = Columns(), check_row: Callable[[dict, str], None] | None = None,
              what: str = "data") -> list[dict]:
    """The checked rows of ``source`` (a file, a ``save_to_disk`` directory, or a cached hub id)."""
    rows = []
    for where, raw in raw_rows(source, columns, what):
        row = _row(raw, columns, where)
        if check_row is not None:
            check_row(row, where)
        rows.append(row)
    if not rows:
        raise UserError(f"{what} {source}: no rows")
    return rows


def _row(raw: dict, c: Columns, where: str) -> dict:
    for key, name in (("prompt", c.prompt), ("answer", c.answer)):
        if name not in raw:
            hint = "" if name != key else f" (--{key}-column names another)"
            raise UserError(f"{where}: missing '{name}'{hint}; columns: {', '.join(map(str, raw)) or 'none'}")
    prompt, answer = raw[c.prompt], raw[c.answer]
    check_prompt(prompt, where, c.prompt)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise UserError(f"{where}: '{c.answer}' must be a string or a number")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise UserError(f"{where}: '{c.answer}' must be a finite number (got {answer})")
    if c.answer_format:
        found = extract_answer(str(answer), c.answer_format)
        if found is None:
            raise UserError(f"{where}: answer format {c.answer_format} finds no answer in {str(answer)[-80:]!r}")
        answer = found
    extra = {k: v for k, v in raw.items() if k not in (c.prompt, c.answer, "prompt", "answer")}
    return {**extra, "prompt": prompt, "answer": answer}


def raw_rows(source: str, c: Columns, what: str) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` for each row of ``source`` as it is stored (``read_rows`` checks them as a task's)."""
    path = Path(source)
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix == ".json":
            yield from _json_rows(path, what)
        elif suffix == ".csv":
            yield from _csv_rows(path, what)
        elif suffix in (".parquet", ".arrow"):
            yield from _table_rows(path, suffix)
        else:  # .jsonl, and any other name (read as JSONL, as before other formats were)
            yield from json_objects(path, what)
        return
    if path.is_dir():
        yield from _disk_rows(path, c, what)
        return
    if suffix in FILE_FORMATS:
        raise UserError(f"{what} {source}: no such file")
    yield from _hub_rows(source, c, what)


def _json_rows(path: Path, what: str) -> Iterator[tuple[str, dict]]:
    """A .json file: a list of objects, an object of equal-length columns, or JSON lines."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except OSError as e:  # (unreadable: a PermissionError traceback; JSONL and Parquet said it in one line)
        raise UserError(f"{what} {path}: cannot be read ({e.strerror or e})") from None
    except json.JSONDecodeError:
        yield from json_objects(path, what)  # JSON lines under a .json name, as `datasets` reads them too
        return
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        n = {len(v) for v in data.values()}
        if len(n) != 1:
            raise UserError(f"{path}: columns of different lengths")
        data = [dict(zip(data, values)) for values in zip(*data.values())]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a list of objects (or an object of columns)")
    for i, row in enumerate(data, start=1):
        if not isinstance(row, dict):
            raise UserError(f"{path}:row {i}: expected an object, got {type(row).__name__}")
        yield f"{path}:row {i}", row


def _csv_rows(path: Path, what: str) -> Iterator[tuple[str, dict]]:
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            for row in reader:
                yield f"{path}:{reader.line_num}", {k: v for k, v in row.items() if k is not None}
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except csv.Error as e:
        raise UserError(f"{path}: not CSV ({e})") from None
    except OSError as e:
        raise UserError(f"{what} {path}: cannot be read ({e.strerror or e})") from None


def _require_datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise UserError(f"{what}: reading it needs the datasets package: pip install 'localrl[data]'") from None
    return datasets


def _table_rows(path: Path, suffix: str) -> Iterator[tuple[str, dict]]:
    datasets = _require_datasets(str(path))  # (its pyarrow reads Parquet)
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        else:
            table = datasets.Dataset.from_file(str(path)).data.table
    except Exception as e:  # pyarrow's and datasets' errors for a file that is not what its name says
        raise UserError(f"{path}: not a readable {suffix[1:]} file ({first_line(e, 160)})") from None
    for i, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}:row {i}", row


def _split_of(found, source: str, c: Columns, what: str):
    """A split of what ``datasets`` returned: a Dataset as is, a DatasetDict's ``c.split``."""
    import datasets

    if isinstance(found, datasets.DatasetDict):
        if c.split not in found:
            field = "eval_split" if what == "eval_data" and c.split == c.eval_split else "data_split"
            raise UserError(f"{what} {source}: no split {c.split!r} (splits: {', '.join(found)}); set "
                            f"--{field.replace('_', '-')}", field=field)
        return found[c.split]
    return found


def _disk_rows(path: Path, c: Columns, what: str) -> Iterator[tuple[str, dict]]:
    datasets = _require_datasets(f"{what} {path}")
    try:
        found = datasets.load_from_disk(str(path))
        rows = _split_of(found, str(path), c, what).to_list()
    except FileNotFoundError:
        raise UserError(f"{what} {path}: a directory, but not one datasets' save_to_disk wrote") from None
    except (ValueError, OSError) as e:  # a damaged state.json (JSON), a cut .arrow file (Arrow's ValueError, OSError)
        raise UserError(f"{what} {path}: a save_to_disk directory that cannot be read ({type(e).__name__}: "
                        f"{first_line(e, 160)})") from None
    for i, row in enumerate(rows, start=1):
        yield f"{path}:row {i}", row


def _hub_rows(source: str, c: Columns, what: str) -> Iterator[tuple[str, dict]]:
    """A hub id from the local ``datasets`` cache, offline: a dataset a user loaded once before."""
    datasets = _require_datasets(f"{what} {source}")
    offline, datasets.config.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE, True  # never a download
    try:
        found = datasets.load_dataset(source, c.config or None)
    except (ConnectionError, FileNotFoundError, ValueError) as e:
        first = first_line(e)
        configs = re.search(r"Available configs in the cache: (\[.*\])", str(e))
        if configs:
            raise UserError(f"{what} {source}: no config {c.config or '(default)'!r} in the local cache (cached: "
                            f"{configs.group(1)}); set --data-config", field="data_config") from None
        raise UserError(f"{what} {source!r}: not a file, a built-in task ({', '.join(BUILTIN_TASKS)}) or a dataset in "
                        f"the local Hugging Face cache ({datasets.config.HF_DATASETS_CACHE}; localrl never "
                        f"downloads: load it once with datasets.load_dataset). {first[:120]}", field="data") from None
    finally:
        datasets.config.HF_HUB_OFFLINE = offline  # the process's own setting, as it was
    split = _split_of(found, source, c, what)
    for i, row in enumerate(split.to_list(), start=1):
        yield f"{source}:{c.split}:row {i}", row
