"""The Agent screen: the model works in a shell, one approved command at a time.

The loop (a thread worker): the model replies; each ``<tool_call>`` it makes is checked against
the working directory's remembered decisions (``localrl.agent.approvals``: prefixes always allowed or
always denied, deny winning; dangerous lines always asked) and otherwise shown for the user to
approve (as is, or edited), reject, or answer for good ("Always" allows the command's first
word in this directory from now on, "Never" denies it). Approved commands run in
``localrl.envs.sandbox`` at the strongest isolation the machine has (shown in the status line); the
result, or the refusal, goes back to the model as the next turn, as in training. "Approve all"
(off by default) skips the question for the rest of the session, except for dangerous lines.
A built-in agent (tiny-shell, a run of it, or its GGUF) gets no system message, as in its
training; other models get the tool-call instructions. The transcript is saved after every event. With "Record"
on (off by default; said in the transcript when a task starts), each task's episode is also appended to the
sessions log (``localrl.agent.session_log``: each proposal, the decision and edit, the output, secrets masked) in
the data directory's ``sessions/``, which ``--objective dpo`` learns from. A recorded task ends with a rating asked
(1 to 5, or none); the episode is written when it is answered, or with no rating when the next task starts or the
screen closes.
"""

from __future__ import annotations

import threading
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Input, Label, Static, Switch
from textual.worker import get_current_worker

from localrl.agent.approvals import Approvals
from localrl.agent.session import agent_system
from localrl.agent.session_log import Episode, SessionLog
from localrl.agent.tool_calls import parse_tool_calls, system_message, tool_response
from localrl.envs.sandbox import Sandbox
from localrl.errors import UserError
from localrl.tui.widgets import Message, save_record
from localrl.visible import hidden_in_command, visible

MAX_TURNS = 8  # model replies per task, so a model that never stops calling tools does stop


class AgentScreen(Screen):
    BINDINGS = [Binding("ctrl+y", "approve", "Approve", id="agent.approve"),
                Binding("ctrl+n", "reject", "Reject", id="agent.reject"),
                Binding("escape", "cancel", "Stop agent", id="agent.cancel")]

    def __init__(self, data_dir: Path, workdir: str | Path = ".", timeout: float = 30.0, max_tokens: int = 512):
        super().__init__()
        self.folder = data_dir / "agent"
        self.approvals_file = data_dir / "approvals.json"
        self.workdir = str(workdir)
        self.timeout = timeout
        self.max_tokens = max_tokens
        self.transcript: list[dict] = []
        self.path: Path | None = None
        self.cancel = threading.Event()
        self._decided = threading.Event()
        self._decision: str | None = None  # the command to run, or None for a refusal
        self._remember: bool | None = None  # with the decision: remember its first word as allowed / denied
        self._proposal: tuple[str, str] = ("", "")  # (the proposed command, as the edit box shows it)
        self.approvals: Approvals | None = None
        self._worker = None  # the agent loop of the current task
        self.approve_all = False  # mirrors the switch; the worker reads this, never the widget
        self.record = False  # mirrors the Record switch: each task's episode is recorded (opt-in)
        self.sessions = SessionLog(data_dir / "sessions")
        self._unrated: tuple[Episode, list[dict]] | None = None  # a recorded episode waiting for its rating

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="agent-bar"):
            yield Label("Dir")
            yield Input(self.workdir, id="workdir", compact=True, select_on_focus=False)  # Tab in: no overwrite
            yield Label("Approve all")
            yield Switch(False, id="approve-all")
            yield Label("Record")
            yield Switch(False, id="record")
        yield Static("", id="agent-status", markup=False)
        yield VerticalScroll(id="transcript")
        with Vertical(id="approval"):
            yield Static("The model wants to run (edit it if you like):")
            yield Static("", id="proposed", markup=False)  # the whole command, wrapped, every byte visible
            yield Input("", id="command", compact=True)
            with Horizontal():
                yield Button("Approve", id="approve", variant="success", compact=True)
                yield Button("Reject", id="reject", variant="error", compact=True)
                yield Button("Always", id="always", compact=True)
                yield Button("Never", id="never", compact=True)
        with Vertical(id="rating"):
            yield Static("Rate the agent's work on this task (kept in the session log):")
            with Horizontal():
                for n in range(1, 6):
                    yield Button(str(n), id=f"rate-{n}", compact=True)
                yield Button("No rating", id="rate-none", compact=True)
        yield Input(placeholder="Task for the agent (Enter starts it)", id="task")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#approval").display = False
        self.query_one("#rating").display = False
        self.watch(self.app, "model_status", lambda s: self.query_one("#agent-status", Static).update(s))
        self.query_one("#transcript", VerticalScroll).anchor()
        self.query_one("#task", Input).focus()

    def on_unmount(self) -> None:
        self.cancel.set()
        self._decided.set()
        self._write_episode(None, show=False)

    # -- user actions ----------------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "command":
            self.action_approve()
        elif event.input.id == "task" and event.value.strip():
            self.start(event.value.strip())
            event.input.value = ""

    def on_switch_changed(self, event: Switch.Changed) -> None:
        if event.switch.id == "approve-all":
            self.approve_all = event.value
        elif event.switch.id == "record":
            self.record = event.value

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "approve":
            self.action_approve()
        elif event.button.id == "reject":
            self.action_reject()
        elif event.button.id.startswith("rate-"):
            self._write_episode(None if event.button.id == "rate-none" else int(event.button.id[len("rate-"):]))
        elif event.button.id in ("always", "never") and self.query_one("#approval").display:
            command = self._edited_command()
            self._decide(command if event.button.id == "always" else None, remember=event.button.id == "always")

    def start(self, task: str) -> None:
        if self.app.chat_model is None:
            self.notify("load a model first (Chat screen, F2)", severity="warning")
            return
        if self._worker is not None and self._worker.is_running:
            self.notify("the agent is still working (esc stops it)", severity="warning")
            return
        try:
            sandbox = Sandbox(self.query_one("#workdir", Input).value, timeout=self.timeout)
            system = agent_system("auto", getattr(self.app, "chat_source", ""))
        except UserError as e:
            self.notify(str(e), severity="error")
            return
        self._write_episode(None)  # the last task's, unrated
        self.approvals = Approvals(sandbox.workdir, self.approvals_file)
        self.cancel.clear()
        self._add("user", task)
        episode = None
        if self.record:
            self._add("tool", self.sessions.describe())
            episode = self.sessions.begin(task, getattr(self.app.chat_model, "name", ""), sandbox.workdir)
        self._set_status(f"sandbox: {sandbox.isolation}, as {sandbox.runs_as}")
        self._worker = self._run(task, sandbox, system, episode)

    def action_approve(self) -> None:
        if self.query_one("#approval").display:
            self._decide(self._edited_command())

    def _edited_command(self) -> str:
        """What runs: the proposed command's exact text if the edit box still shows it as proposed (its hidden
        characters written out), else what the person typed."""
        proposed, shown = self._proposal
        value = self.query_one("#command", Input).value
        return proposed if value == shown else value

    def action_reject(self) -> None:
        if self.query_one("#approval").display:
            self._decide(None)

    def action_cancel(self) -> None:
        self.cancel.set()
        self._decide(None)

    def _decide(self, command: str | None, remember: bool | None = None) -> None:
        self.query_one("#approval").display = False
        self.query_one("#task", Input).focus()  # not the hidden panel: the next thing typed is the next task
        self._decision, self._remember = command, remember
        self._decided.set()

    # -- the agent loop (worker thread) ----------------------------------------------------

    @work(thread=True, exclusive=True, group="agent")
    def _run(self, task: str, sandbox: Sandbox, system: str | None = "", episode: Episode | None = None) -> None:
        first = [system_message(str(sandbox.workdir))] if system == "" else (
            [{"role": "system", "content": system}] if system else [])
        messages = [*first, {"role": "user", "content": task}]
        for _ in range(MAX_TURNS):
            reply = self._stream_reply(messages)
            if reply is None:
                break
            messages.append({"role": "assistant", "content": reply})
            commands = parse_tool_calls(reply)
            if not commands:
                break
            command, decision = self._ask(commands[0])  # one command per turn: the model sees each result
            if self.cancel.is_set():
                break
            if command is None:
                self._call(self._add, "tool", f"rejected: {commands[0]}")
                messages.append(tool_response("The user rejected this command. Do not run it; ask or try "
                                              "something else."))
                if episode is not None:
                    episode.turn(len(messages) - 2, commands[0], decision, None)
                continue
            self._call(self._set_status, f"running: {visible(command, command=True)}")
            result = sandbox.run(command)
            self._call(self._add, "tool", result.describe(), {"command": command, "exit_code": result.exit_code,
                                                              "timed_out": result.timed_out})
            messages.append(tool_response(result.describe(echo=False)))
            if episode is not None:
                episode.turn(len(messages) - 2, commands[0], decision, command, result.exit_code,
                             result.describe(echo=False))
        self._call(self._set_status, "stopped" if self.cancel.is_set() else "done")
        if episode is not None and get_current_worker().is_cancelled:  # the app is closing: no one to ask
            self.sessions.end(episode, messages)
        elif episode is not None:
            self._call(self._ask_rating, episode, messages)

    def _stream_reply(self, messages: list[dict]) -> str | None:
        view = self.app.call_from_thread(self._add, "assistant", "", streaming=True)
        try:
            for delta in self.app.chat_model.stream(messages, max_tokens=self.max_tokens, cancel=self.cancel):
                view.feed(delta)
        except Exception as e:  # shown, and the loop ends; the app stays up
            self._call(self._finish_reply, view, f"error: {e}")
            return None
        self._call(self._finish_reply, view, "cancelled" if self.cancel.is_set() else "")
        return None if self.cancel.is_set() else view.text

    def _ask(self, command: str) -> tuple[str | None, str]:
        """(the command to run, None for none; the decision as a session log names it)."""
        decision, why = self.approvals.decide(command)
        if decision != "ask":
            self._call(self._add, "tool", f"{'allowed' if decision == 'allow' else 'refused'} without asking: {why}")
            return (command, "allowed") if decision == "allow" else (None, "refused")
        if self.approve_all and why == "not yet allowed here":  # dangerous or opaque lines are always asked
            return command, "approved"
        self._decided.clear()
        self._call(self._show_approval, command)
        worker = get_current_worker()
        while not self._decided.wait(0.1):
            if worker.is_cancelled:  # the app is closing
                self.cancel.set()
                return None, "rejected"
        if self._remember is not None:
            first_word = (self._decision or command).split()[:1]
            if first_word:
                self.approvals.remember(first_word[0], allow=self._remember)
        if self._decision is None:
            return None, "rejected"
        return self._decision, "approved" if self._decision == command else "edited"

    def _call(self, fn, *args):
        return self.app.call_from_thread(fn, *args)

    # -- UI thread ---------------------------------------------------------------------------

    def _show_approval(self, command: str) -> None:
        self.query_one("#approval").display = True
        shown = visible(command, command=True)
        hidden = hidden_in_command(command)
        warning = (f"\nWARNING: this command holds characters that act on a terminal or cannot be seen, written out "
                   f"here as {' '.join(hidden)}; they run as the characters they stand for") if hidden else ""
        self.query_one("#proposed", Static).update(shown + warning)
        self._proposal = (command, shown.replace("\n", "\\n"))
        box = self.query_one("#command", Input)
        box.value = self._proposal[1]
        box.focus()
        self._set_status("waiting for approval")

    def _ask_rating(self, episode: Episode, messages: list[dict]) -> None:
        self._unrated = (episode, messages)
        self.query_one("#rating").display = True
        self._set_status("rate this task, or start the next one (no rating)")

    def _write_episode(self, rating: int | None, show: bool = True) -> None:
        """The recorded episode waiting for its rating, written with ``rating`` (None: no rating)."""
        if self._unrated is None:
            return
        (episode, messages), self._unrated = self._unrated, None
        self.sessions.end(episode, messages, rating)
        if show:
            self.query_one("#rating").display = False
            self.query_one("#task", Input).focus()
            self._add("tool", f"recorded to {self.sessions.path}" + (f", rated {rating}" if rating else ""))

    def _finish_reply(self, view: Message, note: str) -> None:
        view.finish(note)
        self.transcript[-1]["content"] = view.text
        self.save()

    def _add(self, role: str, text: str, extra: dict | None = None, streaming: bool = False) -> Message:
        view = Message(role, text, streaming)
        self.query_one("#transcript", VerticalScroll).mount(view)
        self.transcript.append({"role": role, "content": text, **(extra or {})})
        self.save()
        return view

    def _set_status(self, text: str) -> None:
        self.query_one("#agent-status", Static).update(text)

    def save(self) -> Path:
        data = {"model": getattr(self.app.chat_model, "name", None), "workdir": self.workdir,
                "transcript": self.transcript}
        self.path = save_record(self.folder, self.path, data)
        return self.path
