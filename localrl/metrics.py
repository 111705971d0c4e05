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
from pathlib import Path
from typing import Callable

from localrl.atomic import write_text_atomic

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
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        for listener in self.listeners:
            listener(record)

    def write_to(self, path: Path, records: list[dict] | None = None) -> None:
        """Append every record from now on to ``path``; with ``records``, first replace what the
        file holds with them, atomically (on resume: drop the steps after the checkpoint)."""
        self.close()
        if records is not None:
            write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict]:
    """All complete records of a metrics file (a torn last line from a crash is skipped)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
