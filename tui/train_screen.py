"""The Train screen: a form checked as the CLI checks it, a training subprocess, and live charts
read from the run's metrics.jsonl.

Training runs as ``python -m localrl.cli train`` in a subprocess: a crash there is shown here
(its exit status and last lines) and cannot take the app down, and Stop sends it Ctrl-C, which
saves a checkpoint that Resume continues from. The watcher reads only what was appended to
the metrics file since the last tick; ``--attach RUN_DIR`` watches a run started elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections import deque
from datetime import datetime
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Input, Label, ProgressBar, RichLog, Static

from localrl.config import TrainConfig, build_config, load_toml
from localrl.errors import UserError
from tui.widgets import REDRAW_INTERVAL, MetricChart

# (config field, label) of the form; anything else goes in "flags", as on the command line
FORM_FIELDS = [("model", "Model"), ("data", "Task"), ("steps", "Steps"), ("group_size", "Group G"),
               ("prompts_per_step", "Prompts"), ("lr", "LR")]
CHARTS = [("reward_mean", "reward", "{:.3f}"), ("accuracy", "accuracy", "{:.1%}"), ("kl", "KL", "{:.4f}"),
          ("loss", "loss", "{:.4f}"), ("tokens_per_s", "tokens/s", "{:.0f}"), ("peak_mem_mb", "memory MB", "{:.0f}")]
TRAIN_COMMAND = [sys.executable, "-m", "localrl.cli", "train"]


def form_command(values: dict[str, str], flags: str) -> tuple[list[str], TrainConfig]:
    """(``localrl train`` arguments, the run config) for the form's fields followed by its extra
    flags (which win, as later flags do on the command line), checked as ``localrl train``
    checks them, before any weights load."""
    from localrl.cli import _overrides, build_parser
    from localrl.trainer import preflight

    argv = []
    for field, value in values.items():
        if value.strip():
            argv += ["--" + field.replace("_", "-"), value.strip()]
    try:
        argv += shlex.split(flags)
    except ValueError as e:
        raise UserError(f"flags: {e}") from None
    try:
        args = build_parser().parse_args(["train", *argv])
    except SystemExit:
        raise UserError(f"flags: cannot parse {flags!r} (use --field value, as with localrl train)") from None
    cfg = build_config(args.config, _overrides(args))
    preflight(cfg)
    return argv, cfg


class MetricsFollower:
    """New records of a metrics file since the last read; starts over if the file was rewritten (resume)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.inode = path, 0, None
        self.records: list[dict] = []

    def poll(self) -> bool:
        """Read what was appended; whether anything new arrived."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return False
        if st.st_ino != self.inode or st.st_size < self.offset:  # replaced on resume
            self.inode, self.offset, self.records = st.st_ino, 0, []
        if st.st_size == self.offset:
            return False
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a half-written last line waits for the next tick
        self.offset += len(complete)
        for line in complete.decode("utf-8").splitlines():
            try:
                self.records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return bool(complete)


class TrainScreen(Screen):
    # function keys: every ctrl+letter worth having is already an editing key in the form's inputs
    BINDINGS = [Binding("f5", "start", "Start", id="train.start"),
                Binding("f6", "stop", "Stop", id="train.stop"),
                Binding("f7", "resume", "Resume", id="train.resume")]

    def __init__(self, runs_dir: str | Path = "runs", attach: str | Path | None = None,
                 train_command: list[str] | None = None):
        super().__init__()
        self.runs_dir = Path(runs_dir)
        self.train_command = train_command or TRAIN_COMMAND
        self.run_dir: Path | None = Path(attach) if attach else None
        self.proc: subprocess.Popen | None = None
        self.follower = MetricsFollower(self.run_dir / "metrics.jsonl") if self.run_dir else None
        self.total_steps = 0
        self._log_lines: deque[str] = deque()  # output waiting for the next redraw
        self._tail: deque[str] = deque(maxlen=20)  # the run's last output lines, unwrapped
        self.status = ""

    def compose(self) -> ComposeResult:
        defaults = TrainConfig()
        yield Header(show_clock=False)
        with Horizontal():
            with Vertical(id="form"):
                for field, label in FORM_FIELDS:
                    with Horizontal(classes="field"):
                        yield Label(label)
                        yield Input(str(getattr(defaults, field)), id=f"field-{field}", compact=True)
                with Horizontal(classes="field"):
                    yield Label("Flags")
                    yield Input("", placeholder="more flags: --beta 0 ...", id="field-flags", compact=True)
                with Horizontal(id="buttons"):
                    yield Button("Start", id="start", variant="success", compact=True)
                    yield Button("Stop", id="stop", variant="error", compact=True)
                    yield Button("Resume", id="resume", compact=True)
                yield Static("", id="form-error")
            with Vertical(id="watch"):
                yield Static("no run yet: fill the form and press Start", id="run-status")
                with Grid(id="charts"):
                    for key, title, fmt in CHARTS:
                        yield MetricChart(key, title, fmt, id=f"chart-{key}")
                yield ProgressBar(total=None, show_eta=True, id="progress")
                yield RichLog(id="log", max_lines=2000, wrap=True, min_width=20, markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#progress").display = False  # until there is a run to show
        self.set_interval(REDRAW_INTERVAL * 2, self.tick)
        if self.run_dir is not None:
            self._watch(self.run_dir, f"attached to {self.run_dir}")

    # -- form and process -------------------------------------------------------------

    def on_button_pressed(self, event: Button.Pressed) -> None:
        {"start": self.action_start, "stop": self.action_stop, "resume": self.action_resume}[event.button.id]()

    def action_start(self) -> None:
        if self.running:
            return self._error("a run is in progress: stop it first")
        values = {f: self.query_one(f"#field-{f}", Input).value for f, _ in FORM_FIELDS}
        for inp in self.query("#form Input"):
            inp.remove_class("-invalid")
        try:
            argv, cfg = form_command(values, self.query_one("#field-flags", Input).value)
        except UserError as e:
            return self._error(str(e))
        if not cfg.run_dir:
            cfg.run_dir = str(self.runs_dir / f"{datetime.now():%Y%m%d-%H%M%S}")
            argv += ["--run-dir", cfg.run_dir]
        self._launch([*self.train_command, *argv], Path(cfg.run_dir), cfg.steps)

    def action_resume(self) -> None:
        if self.running:
            return self._error("a run is in progress")
        if self.run_dir is None or not (self.run_dir / "config.toml").is_file():
            return self._error("nothing to resume: start a run first (or attach to one)")
        self._launch([*self.train_command, "--resume", str(self.run_dir)], self.run_dir, None)

    def action_stop(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGINT)  # the trainer saves a checkpoint and exits
            self._set_status(f"stopping {self.run_dir} (saving a checkpoint)...")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _error(self, text: str) -> None:
        """Show a user error under the form and mark the field it names."""
        self.query_one("#form-error", Static).update(text)
        named = re.match(r"(?:config field )?(\w+)", text)
        for inp in self.query(f"#field-{named.group(1)}" if named else "#no-such-field"):
            inp.add_class("-invalid")

    def _launch(self, argv: list[str], run_dir: Path, steps: int | None) -> None:
        self.query_one("#form-error", Static).update("")
        self.query_one("#log", RichLog).clear()
        self._tail.clear()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        self._watch(run_dir, f"training {run_dir}", steps)
        self._pump_output(self.proc)

    def _watch(self, run_dir: Path, status: str, steps: int | None = None) -> None:
        self.run_dir = run_dir
        self.follower = MetricsFollower(run_dir / "metrics.jsonl")
        self.total_steps = steps or self._steps_from_config()
        bar = self.query_one("#progress", ProgressBar)
        bar.display = True
        bar.update(total=self.total_steps or None, progress=0)
        self._set_status(status)

    @work(thread=True, group="train-output")
    def _pump_output(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._log_lines.append(line.rstrip("\n"))
            self._tail.append(line.strip())
        code = proc.wait()
        self.app.call_from_thread(self._finished, proc, code)

    def _finished(self, proc: subprocess.Popen, code: int) -> None:
        if proc is not self.proc:
            return
        self.tick()
        if code == 0:
            self._set_status(f"finished: {self.run_dir}")
        elif code == 130:
            self._set_status(f"stopped with a checkpoint: {self.run_dir} (Resume continues it)")
        else:
            last = next((line for line in reversed(self._tail) if line), "")
            self._set_status(f"training failed (exit {code}): {last}", error=True)
            self.notify(f"training failed (exit {code}): {last}", severity="error", timeout=10)

    def _set_status(self, text: str, error: bool = False) -> None:
        self.status = text
        status = self.query_one("#run-status", Static)
        status.update(text + self._eval_summary())
        status.set_class(error, "-error")

    def _eval_summary(self) -> str:
        evals = [r for r in (self.follower.records if self.follower else []) if r.get("kind") == "eval"]
        return "".join(f"  eval {r['when']}: {r['accuracy']:.1%}" for r in evals)

    # -- the watcher (one redraw per tick, however much arrived) ------------------------

    def tick(self) -> None:
        if self._log_lines:
            log = self.query_one("#log", RichLog)
            while self._log_lines:
                log.write(self._log_lines.popleft())
        if self.follower is None or not self.follower.poll():
            return
        if not self.total_steps:
            self.total_steps = self._steps_from_config()
        train = [r for r in self.follower.records if r.get("kind") == "train"]
        for chart in self.query(MetricChart):
            chart.set_values([float(r[chart.key]) for r in train if chart.key in r])
        bar = self.query_one("#progress", ProgressBar)
        bar.update(total=self.total_steps or None, progress=train[-1]["step"] if train else 0)
        self._set_status(self.status, self.query_one("#run-status").has_class("-error"))

    def _steps_from_config(self) -> int:
        try:
            return int(load_toml(self.run_dir / "config.toml").get("steps", 0))
        except UserError:  # not written yet, or damaged: no total to show
            return 0

    def on_unmount(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGINT)
