"""Widgets the screens share: a metric chart and a chat message that streams with its
``<think>`` section dimmed and collapsible.

Streaming text is fed from worker threads with ``feed`` (a deque append, safe against the UI
thread's pops without a lock) and drawn by the message's own timer on the UI thread until
``finish``, so a fast model costs at most one redraw per tick however many tokens arrive.
"""

from __future__ import annotations

import json
from collections import deque
from datetime import datetime
from pathlib import Path

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Label, Sparkline, Static

from localrl.atomic import write_text_atomic
from localrl.visible import visible

REDRAW_INTERVAL = 1 / 20  # seconds between redraws of streaming text and charts


class MetricChart(Vertical):
    """A label with the latest value over a sparkline of the whole history."""

    def __init__(self, key: str, title: str, fmt: str = "{:.3f}", **kwargs):
        super().__init__(classes="metric", **kwargs)
        self.key, self.title, self.fmt = key, title, fmt
        self.values: list[float] = []

    def compose(self) -> ComposeResult:
        yield Label(f"{self.title} -", classes="metric-title")
        yield Sparkline([], summary_function=max)

    def set_values(self, values: list[float]) -> None:
        self.values = list(values)
        last = self.fmt.format(values[-1]) if values else "-"
        self.query_one(Label).update(f"{self.title} {last}")
        self.query_one(Sparkline).data = self.values


def split_think(text: str) -> tuple[str | None, str]:
    """(thinking, the rest) of a reply; thinking is None without a ``<think>`` tag."""
    start = text.find("<think>")
    if start < 0:
        return None, text
    end = text.find("</think>", start)
    if end < 0:  # still thinking
        return text[start + len("<think>"):], text[:start]
    return text[start + len("<think>"):end], text[:start] + text[end + len("</think>"):]


class Message(Vertical):
    """One turn of a conversation. A ``streaming`` one is drawn on a timer from what ``feed``
    receives, until ``finish``."""

    def __init__(self, role: str, text: str = "", streaming: bool = False, **kwargs):
        super().__init__(classes=f"message {role}", **kwargs)
        self.role = role
        self.text = text
        self.streaming = streaming
        self._timer = None
        self._pending: deque[str] = deque()  # appended by a worker thread, popped by the UI thread
        self.note = ""
        self._body = Static("", classes="body", markup=False)
        self._think_text = Static("", classes="think-text", markup=False)
        self._think = Collapsible(self._think_text, title="thinking", collapsed=False, classes="think")

    def compose(self) -> ComposeResult:
        if self.role == "assistant":
            yield self._think
        yield self._body

    def on_mount(self) -> None:
        self._render_text()
        if self.streaming:
            self._timer = self.set_interval(REDRAW_INTERVAL, self.flush)

    def feed(self, delta: str) -> None:  # any thread
        self._pending.append(delta)

    def flush(self) -> bool:
        """Draw what was fed since the last flush; whether anything changed."""
        if not self._pending:
            return False
        pieces = []
        while self._pending:  # never swap the deque: a worker may be appending to it right now
            pieces.append(self._pending.popleft())
        self.text += "".join(pieces)
        self._render_text()
        return True

    def finish(self, note: str = "") -> None:
        self.streaming = False
        if self._timer is not None:
            self._timer.stop()
        self.flush()
        self.note = note
        self._render_text()

    def set_collapsed(self, collapsed: bool) -> None:
        self._think.collapsed = collapsed

    def _render_text(self) -> None:
        # The widgets are held, not queried: this may run before they are mounted (on_mount redraws).
        prefix = {"user": "you: ", "assistant": "", "tool": ""}.get(self.role, "")
        think, rest = split_think(self.text) if self.role == "assistant" else (None, self.text)
        self._think.display = think is not None
        self._think.title = f"thinking ({len(think or '')} chars)"
        self._think_text.update(visible(think or ""))  # model text: every control character written out
        self._body.update(visible(prefix + rest.strip() + (f"\n[{self.note}]" if self.note else "")))


def save_record(folder: Path, path: Path | None, data: dict) -> Path:
    """Write ``data`` as JSON (atomically) to ``path``, or to a new timestamped file in ``folder``."""
    if path is None:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{datetime.now():%Y%m%d-%H%M%S-%f}.json"
    write_text_atomic(path, json.dumps(data, indent=1, ensure_ascii=False))
    return path
