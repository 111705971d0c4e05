"""The Chat screen: talk to a GGUF, a run or a model; replies stream in, ``<think>`` dimmed and
collapsible; esc cancels a reply; every conversation is saved and can be reopened.

The model is the app's (loaded once, shared with the Agent screen). Generation runs in a
thread worker; tokens reach the screen through ``Message.feed`` and are drawn on a timer.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Header, Input, OptionList, Static
from textual.widgets.option_list import Option

from localrl.runs import newest_run
from localrl.serving.chat import stream_fitted
from localrl.tui.widgets import Message, save_record


def list_conversations(folder: Path) -> list[tuple[Path, str]]:
    """(file, a one-line title) of the saved conversations, newest first."""
    out = []
    for path in sorted(folder.glob("*.json"), reverse=True):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        first = next((m["content"] for m in data.get("messages", []) if m.get("role") == "user"), "(empty)")
        out.append((path, f"{path.stem}  {data.get('model', '?')}  {first[:40]}"))
    return out


class OpenConversation(ModalScreen[Path | None]):
    BINDINGS = [Binding("escape", "dismiss(None)", "Close")]

    def __init__(self, folder: Path):
        super().__init__()
        self.items = list_conversations(folder)

    def compose(self) -> ComposeResult:
        options = [Option(title, id=str(path)) for path, title in self.items] or [Option("no saved conversations",
                                                                                       disabled=True)]
        yield OptionList(*options, id="conversations")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(Path(event.option.id))


class ChatScreen(Screen):
    BINDINGS = [Binding("escape", "cancel", "Cancel reply", id="chat.cancel"),
                Binding("ctrl+n", "new", "New chat", id="chat.new"),
                Binding("ctrl+o", "open", "Open chat", id="chat.open"),
                Binding("ctrl+t", "toggle_thinking", "Thinking", id="chat.thinking")]

    def __init__(self, data_dir: Path, source: str = "", max_tokens: int = 512, runs_dir: Path | None = None):
        super().__init__()
        self.source = source
        self.runs_dir = runs_dir
        self.folder = data_dir / "chats"
        self.max_tokens = max_tokens
        self.messages: list[dict] = []
        self.path: Path | None = None
        self.cancel = threading.Event()
        self.streaming: Message | None = None
        self.thinking_collapsed = False
        self.outgrown = False  # whether the model was told so already

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="model-bar"):
            yield Input(self.source, placeholder="model: FILE.gguf, run directory, model directory or built-in name",
                        id="source", compact=True)
            yield Button("Load", id="load", compact=True)
        yield Static("", id="chat-status")
        yield VerticalScroll(id="conversation")
        yield Input(placeholder="Message (Enter sends, esc cancels a reply)", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.watch(self.app, "model_status", self._model_status)
        self.query_one("#conversation", VerticalScroll).anchor()
        self._offer_newest_run()
        self.query_one("#prompt" if self.app.chat_model else "#source", Input).focus()

    def _model_status(self, status: str) -> None:
        self.query_one("#chat-status", Static).update(status)
        if self.app.chat_model is not None and self.is_current:
            self.query_one("#prompt", Input).focus()

    def on_screen_resume(self) -> None:
        self._offer_newest_run()
        self.query_one("#prompt" if self.app.chat_model else "#source", Input).focus()

    def _offer_newest_run(self) -> None:
        """With no model loaded and nothing typed, the source field offers the newest trained run (Enter loads it)."""
        source = self.query_one("#source", Input)
        if self.app.chat_model is None and not source.value.strip() and self.runs_dir is not None:
            newest = newest_run(self.runs_dir)
            if newest is not None:
                source.value = str(newest)

    def on_unmount(self) -> None:
        self.cancel.set()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "load":
            self.app.load_model(self.query_one("#source", Input).value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "source":
            self.app.load_model(event.value)
        elif event.input.id == "prompt" and event.value.strip():
            if self.streaming is not None:
                self.notify("a reply is still streaming (esc cancels it)", severity="warning")
                return
            if self.app.chat_model is None:
                self.notify("load a model first", severity="warning")
                return
            event.input.value = ""
            self.send(event.value.strip())

    def send(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        reply = Message("assistant", streaming=True)
        conversation = self.query_one("#conversation", VerticalScroll)
        conversation.mount(Message("user", text))
        conversation.mount(reply)
        reply.set_collapsed(self.thinking_collapsed)
        self.streaming = reply
        self.cancel.clear()
        self._generate(list(self.messages), reply)

    @work(thread=True, exclusive=True, group="chat")
    def _generate(self, messages: list[dict], reply: Message) -> None:
        note = ""
        try:
            for delta in stream_fitted(self.app.chat_model, messages, self._outgrew, max_tokens=self.max_tokens,
                                       cancel=self.cancel):
                reply.feed(delta)
            note = "cancelled" if self.cancel.is_set() else ""
        except Exception as e:  # a model error is shown in the conversation, not raised into the app
            note = f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        self.app.call_from_thread(self._done, reply, note)

    def _outgrew(self, context: int | None) -> None:
        """The conversation no longer fits the model's context: its oldest turns are left out (said once)."""
        if not self.outgrown:
            self.outgrown = True
            self.app.call_from_thread(self.notify, "the conversation outgrew the model's context" + (
                f" of {context} tokens" if context else "") + ": its oldest turns are left out from now on",
                                      timeout=8)

    def _done(self, reply: Message, note: str) -> None:
        reply.finish(note)
        if reply is not self.streaming:  # the conversation was replaced meanwhile
            return
        self.streaming = None
        self.messages.append({"role": "assistant", "content": reply.text})
        self.save()

    def save(self) -> Path:
        data = {"model": getattr(self.app.chat_model, "name", None), "messages": self.messages}
        self.path = save_record(self.folder, self.path, data)
        return self.path

    def action_cancel(self) -> None:
        if self.streaming is not None:
            self.cancel.set()

    def action_new(self) -> None:
        self.action_cancel()
        self.streaming, self.messages, self.path, self.outgrown = None, [], None, False
        self.query_one("#conversation", VerticalScroll).remove_children()

    def action_open(self) -> None:
        def opened(path: Path | None) -> None:
            if path is not None:
                self.load_conversation(path)

        self.app.push_screen(OpenConversation(self.folder), opened)

    def load_conversation(self, path: Path) -> None:
        self.action_new()
        data = json.loads(path.read_text(encoding="utf-8"))
        self.messages, self.path, self.outgrown = list(data.get("messages", [])), path, False
        conversation = self.query_one("#conversation", VerticalScroll)
        for m in self.messages:
            conversation.mount(Message(m["role"], m["content"]))

    def action_toggle_thinking(self) -> None:
        self.thinking_collapsed = not self.thinking_collapsed
        for message in self.query(Message):
            message.set_collapsed(self.thinking_collapsed)
