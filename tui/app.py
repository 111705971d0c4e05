"""``localrl tui``: the Textual app. Three screens (Train, Chat, Agent) as modes, switched with
F1-F3 or from the command palette (ctrl+p); the chat model is loaded once and shared by the
Chat and Agent screens.
"""

from __future__ import annotations

import os
from pathlib import Path

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.reactive import reactive

from localrl.errors import UserError
from localrl.runs import Run
from localrl.serving.chat import ChatModel
from localrl.tui.agent_screen import AgentScreen
from localrl.tui.chat_screen import ChatScreen
from localrl.tui.train_screen import TrainScreen


def default_data_dir() -> Path:
    """Where conversations and agent transcripts are kept ($XDG_DATA_HOME/localrl)."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local/share") / "localrl"


class LocalRLApp(App):
    TITLE = "localrl"
    CSS_PATH = "app.tcss"
    BINDINGS = [Binding("f1", "switch_mode('train')", "Train", id="app.train"),
                Binding("f2", "switch_mode('chat')", "Chat", id="app.chat"),
                Binding("f3", "switch_mode('agent')", "Agent", id="app.agent"),
                Binding("ctrl+q", "quit", "Quit", id="app.quit", priority=True)]

    model_status: reactive[str] = reactive("no model loaded: enter one above (a .gguf, a run or a model)")

    def __init__(self, attach: str | Path | None = None, model: str | ChatModel | None = None,
                 workdir: str | Path = ".", runs_dir: str | Path = "runs", data_dir: str | Path | None = None,
                 start: str | None = None):
        super().__init__()
        self.chat_model: ChatModel | None = None
        self.chat_source = ""  # what chat_model was loaded from (a GGUF, a run, a model)
        self.data_dir = Path(data_dir) if data_dir else default_data_dir()
        self.runs_dir = Path(runs_dir)
        self._screens = {"train": lambda: TrainScreen(runs_dir, attach),
                         "chat": lambda: ChatScreen(self.data_dir, model if isinstance(model, str) else "",
                                                    runs_dir=self.runs_dir),
                         "agent": lambda: AgentScreen(self.data_dir, workdir)}
        self._model = model
        self._start = start or ("train" if attach or not model else "chat")

    def on_mount(self) -> None:
        for mode, make in self._screens.items():
            self.add_mode(mode, make)
        self.switch_mode(self._start)
        if isinstance(self._model, str):
            self.load_model(self._model)
        elif self._model is not None:
            self._set_model(self._model, f"model: {self._model.name}")

    def get_system_commands(self, screen):
        yield from super().get_system_commands(screen)
        for mode, help_text in [("train", "start and watch a training run"), ("chat", "talk to a model"),
                                ("agent", "let the model run approved shell commands")]:
            yield SystemCommand(f"{mode.title()} screen", help_text, lambda m=mode: self.switch_mode(m))

    @work(thread=True, exclusive=True, group="load-model")
    def load_model(self, source: str) -> None:
        from localrl.serving.chat import open_chat_model

        source = source.strip()
        if not source:
            return
        self.call_from_thread(setattr, self, "model_status", f"loading {source}...")
        try:
            model = open_chat_model(source)
        except Exception as e:  # a user error or a broken file: shown, never fatal
            still = f"; still talking to {self.chat_source or self.chat_model.name}" if self.chat_model else ""
            text = str(e) if isinstance(e, UserError) else f"{source}: {e}"
            self.call_from_thread(setattr, self, "model_status", f"cannot load {text}{still}")
            return
        self.call_from_thread(self._set_model, model, f"model: {source}", source)

    def _set_model(self, model: ChatModel, status: str, source: str = "") -> None:
        if self.chat_model is not None and self.chat_model is not model:
            self.chat_model.close()
        self.chat_model, self.chat_source = model, source
        self.model_status = status


def run_tui(attach: str | None = None, model: str | None = None, workdir: str = ".", runs_dir: str = "runs") -> int:
    """Run the app until it is quit; its exit status (Textual's: 1 if it stopped on an exception it showed)."""
    if attach is not None:
        Run.open(attach, "attach")
    if not Path(workdir).is_dir():
        raise UserError(f"workdir {workdir}: no such directory")
    app = LocalRLApp(attach=attach, model=model, workdir=workdir, runs_dir=runs_dir)
    app.run()
    return app.return_code or 0
