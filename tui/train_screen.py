"""The Train screen: a form checked as the CLI checks it, a training subprocess, and live charts
read from the run's metrics file.

Training runs as ``python -m localrl.cli train`` in a subprocess: a crash there is shown here
(its exit status and last lines) and cannot take the app down, and Stop sends it Ctrl-C, which
saves a checkpoint that Resume continues from. The watcher reads only what was appended to
the metrics file since the last tick; ``--attach RUN_DIR`` watches a run started elsewhere.
"""

from __future__ import annotations

import os
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

from localrl.config import TrainConfig
from localrl.config_io import flag_name, parse_overrides
from localrl.errors import UserError
from localrl.metrics import eta_seconds, format_duration, parse_record
from localrl.runs import Run, is_run
from localrl.tui.widgets import REDRAW_INTERVAL, MetricChart

# (config field, label) of the form; anything else goes in "flags", as on the command line
FORM_FIELDS = [("model", "Model"), ("data", "Task"), ("steps", "Steps"), ("group_size", "Group G"),
               ("prompts_per_step", "Prompts"), ("lr", "LR")]
CHARTS = [("reward_mean", "reward", "{:.3f}"), ("accuracy", "accuracy", "{:.1%}"), ("kl", "KL", "{:.4f}"),
          ("loss", "loss", "{:.4f}"), ("tokens_per_s", "tokens/s", "{:.0f}"), ("peak_mem_mb", "memory MB", "{:.0f}")]
TRAIN_COMMAND = [sys.executable, "-m", "localrl.cli", "train"]


def reward_line(train: list[dict], width: int = 12) -> str:
    """Each reward's mean in the latest step, after a sparkline of its last ``width`` steps."""
    parts = []
    for name in train[-1]["rewards"]:
        values = [r["rewards"][name] for r in train[-width:] if _number((r.get("rewards") or {}).get(name))]
        if not values:
            continue
        lo, hi = min(values), max(values)
        bars = "".join(SPARK[0 if hi == lo else round((v - lo) / (hi - lo) * (len(SPARK) - 1))] for v in values)
        parts.append(f"{name} {bars} {values[-1]:.3g}")
    return "rewards: " + "   ".join(parts)


SPARK = "▁▂▃▄▅▆▇█"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def form_command(values: dict[str, str], flags: str) -> tuple[list[str], TrainConfig]:
    """(``localrl train`` arguments, the run config) for the form's fields followed by its extra
    flags (which win, as later flags do on the command line), checked as ``localrl train``
    checks them (config_io.parse_overrides, then the trainer's preflight), before any weights load."""
    from localrl.training.loop import preflight
    from localrl.training.settings import build_config

    try:
        extra = shlex.split(flags)
    except ValueError as e:
        raise UserError(f"flags: {e}", field="flags") from None
    in_flags = {a.partition("=")[0] for a in extra}
    argv, labels, defaults = [], dict(FORM_FIELDS), TrainConfig()
    for field, value in values.items():
        if value.strip():
            argv += [flag_name(field), value.strip()]
        elif flag_name(field) not in in_flags:  # an emptied field is a mistake, not a wish for the default
            raise UserError(f"{labels.get(field, field)}: empty; enter a value (the default is "
                            f"{getattr(defaults, field)})", field=field)
    try:
        overrides = parse_overrides(argv + extra)
    except UserError as e:
        in_form = e.field in values and not any(a.partition("=")[0] == flag_name(e.field or "") for a in extra)
        raise UserError(str(e), field=e.field if in_form else "flags") from None
    cfg = build_config(None, overrides)
    preflight(cfg)
    return argv + extra, cfg


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
        self.records += [r for line in complete.splitlines() if (r := parse_record(line)) is not None]
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
        self._ended = False  # the training process's exit has been handled (_finished)
        self.follower = MetricsFollower(Run(self.run_dir).metrics_path) if self.run_dir else None
        self.total_steps = 0
        self.phase = ""  # what the run does before (or after) its steps: loading, evaluating
        self.eta = ""  # the time left, from the steps the run has measured
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
                        yield Input(str(getattr(defaults, field)), placeholder=f"default {getattr(defaults, field)}",
                                    id=f"field-{field}", compact=True)
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
                yield Static("", id="reward-means", markup=False)
                yield ProgressBar(total=None, show_eta=False, id="progress")  # the ETA: from measured steps
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
            return self._error(str(e), e.field)
        if not cfg.run_dir:
            cfg.run_dir = str(self.runs_dir / f"{datetime.now():%Y%m%d-%H%M%S}")
            argv += ["--run-dir", cfg.run_dir]
        self._launch([*self.train_command, *argv], Path(cfg.run_dir), cfg.steps)

    def action_resume(self) -> None:
        if self.running:
            return self._error("a run is in progress")
        if self.run_dir is None or not is_run(self.run_dir):
            return self._error("nothing to resume: start a run first (or attach to one)")
        self._launch([*self.train_command, "--resume", str(self.run_dir)], self.run_dir, None)

    def action_stop(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGINT)  # the trainer saves a checkpoint and exits
            self._set_status(f"stopping {self.run_dir} (saving a checkpoint)...")

    @property
    def running(self) -> bool:
        """A training process was started here and its exit is not yet handled: until ``_finished`` has read its
        last output and set the final status, the run still counts as running."""
        return self.proc is not None and not self._ended

    def _error(self, text: str, field: str | None = None) -> None:
        """Show a user error under the form and mark the input of the field it names (the flags
        input for a field that is not in the form)."""
        self.query_one("#form-error", Static).update(text)
        if field is not None:
            name = field if field in dict(FORM_FIELDS) else "flags"
            self.query_one(f"#field-{name}", Input).add_class("-invalid")

    def _launch(self, argv: list[str], run_dir: Path, steps: int | None) -> None:
        self.query_one("#form-error", Static).update("")
        self.query_one("#log", RichLog).clear()
        self._tail.clear()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._ended = False
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        self._watch(run_dir, f"training {run_dir}", steps)
        self._pump_output(self.proc)

    def _watch(self, run_dir: Path, status: str, steps: int | None = None) -> None:
        self.run_dir = run_dir
        self.follower = MetricsFollower(Run(run_dir).metrics_path)
        self.total_steps = steps or Run(run_dir).total_steps()
        self.phase = ""
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
        self._ended = True
        self.tick()
        self.phase = ""
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
        said = [r for r in (self.follower.records if self.follower else []) if r.get("kind") in ("warning", "note")]
        warning = (f"\n{said[-1]['kind']} at step {said[-1].get('step', '?')}: {said[-1].get('message', '')}"
                   if said else "")  # the latest warning, or note (every group solved)
        status.update(text + (f": {self.phase}" if self.phase else "") + self.eta + self._eval_summary() + warning)
        status.set_class(error, "-error")

    def _eval_summary(self) -> str:
        evals = [r for r in (self.follower.records if self.follower else []) if r.get("kind") == "eval"]
        return "".join(f"  eval {r.get('when', '?')}: {r['accuracy']:.1%}" +
                       (f" (ECE {r['ece']:.3f})" if _number(r.get("ece")) else "")
                       for r in evals if _number(r.get("accuracy")))

    # -- the watcher (one redraw per tick, however much arrived) ------------------------

    def tick(self) -> None:
        if self._log_lines:
            log = self.query_one("#log", RichLog)
            while self._log_lines:
                log.write(self._log_lines.popleft())
        if self.follower is None or not self.follower.poll():
            return
        if not self.total_steps:
            self.total_steps = Run(self.run_dir).total_steps()
        records = self.follower.records
        train = [r for r in records if r.get("kind") == "train"]
        for chart in self.query(MetricChart):  # a field can be null (kl at beta 0) or absent: no point then
            chart.set_values([float(r[chart.key]) for r in train if _number(r.get(chart.key))])
        means = self.query_one("#reward-means", Static)
        means.display = bool(train and train[-1].get("rewards"))
        if means.display:
            means.update(reward_line(train))
        bar = self.query_one("#progress", ProgressBar)
        last = records[-1] if records else {}
        if last.get("kind") == "status":  # loading, or evaluating: say so, with the evaluation's progress
            counted = _number(last.get("total")) and last["total"] and _number(last.get("done"))
            self.phase = last.get("message", "") + (f" {last['done']}/{last['total']}" if counted else "")
            if counted:
                bar.update(total=last["total"], progress=last["done"])
        else:
            self.phase = ""
            steps = [r["step"] for r in train if _number(r.get("step"))]
            bar.update(total=self.total_steps or None, progress=steps[-1] if steps else 0)
            live = self.proc is None or self.running  # attached to a run, or training one
            left = eta_seconds(train, self.total_steps) if self.total_steps and live else None
            self.eta = f"  (step {steps[-1]}/{self.total_steps}, {format_duration(left)} left)" if left else ""
        self._set_status(self.status, self.query_one("#run-status").has_class("-error"))

    def on_unmount(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGINT)
