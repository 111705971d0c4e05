"""The metrics sink: the one narrow channel from training to everything that watches it.

Each record is a flat dict; ``kind`` is "train" (one per optimizer step), "eval" (held-out
accuracy before and after), "checkpoint" (a checkpoint was saved), "warning" (the run is not
learning, and the likely cause) or "status" (what the run is doing before its first step:
loading, evaluating, with ``done``/``total`` progress). The
sink appends it to the run's metrics file (JSON lines, flushed per line, so ``tail -f``, the terminal UI
or a plotting script can follow a live run) and calls in-process listeners, such as the
CLI's progress bar.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from localrl.atomic import write_text_atomic
from localrl.errors import UserError

Listener = Callable[[dict], None]


class MetricsSink:
    def __init__(self, path: Path | None = None, listeners: list[Listener] | tuple = ()):
        self.path: Path | None = None
        self.listeners = list(listeners)
        self._file = None
        if path is not None:
            self.write_to(path)

    def emit(self, record: dict) -> None:
        if self._file is not None:
            self._append((json.dumps(record) + "\n").encode())
        for listener in self.listeners:
            listener(record)

    def _append(self, line: bytes) -> None:
        """One whole line or none: on a failed write (a full disk) the file is cut back to where it was."""
        fd = self._file.fileno()
        before = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
        except OSError as e:
            try:
                os.ftruncate(fd, before)
            except OSError:
                pass
            raise UserError(f"could not append to {self.path} ({e.strerror or e}); "
                            f"its records up to the last step are intact") from None

    def write_to(self, path: Path, records: list[dict] | None = None) -> None:
        """Append every record from now on to ``path``; with ``records``, first replace what the
        file holds with them, atomically (on resume: drop the steps after the checkpoint)."""
        self.close()
        if records is not None:
            write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
        self.path = path
        self._file = path.open("ab", buffering=0)  # unbuffered: nothing left over to fail again at close

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


TEXT_FIELDS = frozenset({"kind", "stage", "message", "when"})
INT_FIELDS = frozenset({"step", "done", "total", "n", "completions", "micro_batch"})
NUMBER_FIELDS = frozenset({"accuracy", "reward_mean", "reward_std", "loss", "completion_len", "truncated", "lr",
                           "frac_reward_zero_std", "tokens_per_s", "gen_s", "step_s", "peak_mem_mb", "kl", "clip_frac",
                           "is_weight", "wall_time", "reward_length_corr", "ece", "model_tokens"})
NUMBERS_BY_NAME = frozenset({"rewards", "reward_shares"})


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_record(line: bytes | str) -> dict | None:
    """One line of a metrics file as a record, or None if it is no record (not UTF-8, not JSON, not an object with
    a text ``kind``, or a field that readers compute with of the wrong type: a torn line, a hand edit, damage).
    Every reader goes through this, so one bad line costs that line only."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return None
    for key, value in record.items():
        if key in TEXT_FIELDS and not isinstance(value, str) \
                or key in INT_FIELDS and not (isinstance(value, int) and not isinstance(value, bool)) \
                or key in NUMBER_FIELDS and not (value is None or _is_number(value)) \
                or key in NUMBERS_BY_NAME and not (isinstance(value, dict) and
                                                   all(v is None or _is_number(v) for v in value.values())):
            return None
    if record["kind"] in ("train", "eval", "checkpoint") and "step" not in record:
        return None
    return record


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics file; a line that is no record (a torn last line from a crash, damage) is
    skipped (``parse_record``)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return []
    return [r for line in data.splitlines() if (r := parse_record(line)) is not None]


ETA_WINDOW = 20  # the last steps whose times predict the rest


def eta_seconds(train: list[dict], total: int) -> float | None:
    """Seconds until step ``total``: the mean time of the run's last ``ETA_WINDOW`` measured steps (between
    consecutive records' ``wall_time``, so checkpoint writes count; a lone step's own ``step_s``) times the steps
    left. None before the first step. It needs no window of recent progress, so hour-long steps get an ETA too."""
    steps = [r for r in train if isinstance(r.get("step"), int)]
    if not steps:
        return None
    left = max(0, total - steps[-1]["step"])
    walls = [(r["step"], r["wall_time"]) for r in steps[-ETA_WINDOW - 1:] if isinstance(r.get("wall_time"), (int, float))]
    if len(walls) >= 2 and walls[-1][0] > walls[0][0] and walls[-1][1] > walls[0][1]:
        per_step = (walls[-1][1] - walls[0][1]) / (walls[-1][0] - walls[0][0])
    else:
        times = [r["step_s"] for r in steps[-ETA_WINDOW:] if isinstance(r.get("step_s"), (int, float))]
        if not times:
            return None
        per_step = sum(times) / len(times)
    return left * per_step


def format_duration(seconds: float | None) -> str:
    """``1:02:03`` (or ``-:--:--`` when unknown)."""
    if seconds is None:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


Progress = Callable[[int, int], None]  # (items done, items in all)
PROGRESS_SECONDS = 1.0  # the least time between two progress reports


def item_progress(progress: Progress | None, every: float | None = None) -> Progress | None:
    """``progress`` called only when the count of items done changes, at most once per ``every`` seconds
    (``PROGRESS_SECONDS``), and always for the last item: per-item progress that does not flood a metrics file."""
    if progress is None:
        return None
    every = PROGRESS_SECONDS if every is None else every
    last = {"done": -1, "at": 0.0}

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or (done != last["done"] and now - last["at"] >= every):
            last.update(done=done, at=now)
            progress(done, total)
    return report
