"""Recorded agent sessions: what a person decided about each command a model proposed, kept on this machine.

Opt-in (``localrl agent --record``, the terminal UI's Record switch), and said when a session starts. Each
episode (one task) becomes one JSON line of ``sessions.jsonl`` in the chosen directory, written when the episode
ends (a line is whole or absent; the file is the user's alone, mode 600):

    {"version": 1, "time", "model", "workdir", "task",
     "messages": the conversation as the model saw it (system, task, its replies, the tool results),
     "turns": [{"message": index of the model's reply in messages, "proposed": the command it proposed,
                "decision": approved | edited | rejected | allowed | refused (the last two: by a remembered rule,
                without asking), "command": what ran (the edit, for edited; null when nothing ran),
                "exit_code", "output"}],
     "answer": the model's last reply without a tool call (null if it never gave one), "rating": 1-5 or null}

Nothing in it leaves the machine, and secrets are not written: every text is masked (``mask``) before it is kept:
the values of environment variables whose names say they are secret (``*KEY*``, ``*TOKEN*``, ``*SECRET*``,
``*PASSWORD*``, ...), assignments of such names in any output (``API_KEY=...``, ``password: ...``), and tokens of
well-known shapes (``sk-...``, ``ghp_...``, ``AKIA...``, ``hf_...``); each tool output is cut to ``OUTPUT_CAP``
characters. The sessions are training data: ``--objective dpo --sampler preferences --data DIR`` learns from them
(``localrl.data.preferences.session_pairs``).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from localrl.errors import UserError

VERSION = 1
FILE = "sessions.jsonl"
OUTPUT_CAP = 4000  # characters of one tool output kept
DECISIONS = ("approved", "edited", "rejected", "allowed", "refused")
# a name one of whose underscore-separated parts says secret (OPENAI_API_KEY, my_token; not KEYBOARD, not PWD)
_SECRET_NAME = r"(?:[A-Za-z0-9]+_)*(?:KEY|TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?|AUTH|COOKIE)(?:_[A-Za-z0-9]+)*"
_ASSIGNMENT = re.compile(rf"(?i)\b({_SECRET_NAME})(\s*[=:]\s*)(['\"]?)([^\s'\";,]+)")
_TOKEN_SHAPES = re.compile(r"\b(?:sk-[A-Za-z0-9_-]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|"
                           r"AKIA[0-9A-Z]{16}|xox[abprs]-[A-Za-z0-9-]{10,}|hf_[A-Za-z0-9]{20,})")
MASK = "[masked]"


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
    """The values of the environment's variables whose names say they are secret (4 characters or more), longest
    first."""
    environ = os.environ if environ is None else environ
    named = re.compile(rf"(?i)^{_SECRET_NAME}$")
    return sorted({v for k, v in environ.items() if named.match(k) and len(v) >= 4}, key=len, reverse=True)


def mask(text: str, secrets: list[str]) -> str:
    """``text`` with ``secrets`` (values), secret assignments and token-shaped strings replaced by ``[masked]``."""
    for value in secrets:
        text = text.replace(value, MASK)
    text = _ASSIGNMENT.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3)}{MASK}"
                           if m.group(4) != MASK else m.group(0), text)
    return _TOKEN_SHAPES.sub(MASK, text)


def cap(text: str, limit: int = OUTPUT_CAP) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} characters not kept]"


@dataclass
class Episode:
    """One task's record, filled in as the session goes (``SessionLog.begin``), written by ``SessionLog.end``."""

    task: str
    model: str
    workdir: str
    secrets: list[str]
    turns: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.time)

    def turn(self, message: int, proposed: str, decision: str, command: str | None, exit_code: int | None = None,
             output: str | None = None) -> None:
        """The model's reply ``messages[message]`` proposed ``proposed``; the person (or a remembered rule) decided
        ``decision``; ``command`` ran (None: nothing did) and printed ``output``."""
        if decision not in DECISIONS:
            raise ValueError(f"decision {decision!r}: one of {', '.join(DECISIONS)}")
        self.turns.append({"message": message, "proposed": mask(proposed, self.secrets), "decision": decision,
                           "command": None if command is None else mask(command, self.secrets),
                           "exit_code": exit_code,
                           "output": None if output is None else cap(mask(output, self.secrets))})

    def record(self, messages: list[dict], rating: int | None) -> dict:
        last = messages[-1] if messages else {}
        answered = last.get("role") == "assistant" and "<tool_call>" not in last.get("content", "")
        kept = [{**m, "content": mask(cap(m["content"], 4 * OUTPUT_CAP), self.secrets)} for m in messages]
        return {"version": VERSION, "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.started)),
                "model": self.model, "workdir": self.workdir, "task": mask(self.task, self.secrets),
                "messages": kept, "turns": self.turns, "answer": kept[-1]["content"] if answered else None,
                "rating": rating}


class SessionLog:
    """The directory sessions are recorded in (created private, mode 700; the file mode 600)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).expanduser()
        if self.directory.exists() and not self.directory.is_dir():
            raise UserError(f"--record {directory}: not a directory")
        self.path = self.directory / FILE

    def check(self) -> None:
        """That episodes can be written here, found before an episode starts rather than after it (one line)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        except OSError as e:
            raise UserError(f"--record {self.directory}: cannot be written ({e.strerror or e})") from None

    def begin(self, task: str, model: str, workdir: str | Path) -> Episode:
        return Episode(task, str(model), str(workdir), secret_values())

    def end(self, episode: Episode, messages: list[dict], rating: int | None = None) -> dict:
        """Append ``episode`` (``messages``: the whole conversation) as one line; returns the record written."""
        if rating is not None and not 1 <= rating <= 5:
            raise UserError(f"rating {rating}: from 1 to 5")
        record = episode.record(messages, rating)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line)  # one write of a whole line: a reader sees it whole or not at all
            os.fsync(fd)
        finally:
            os.close(fd)
        return record

    def describe(self) -> str:
        return (f"recording this session to {self.path} (it stays on this machine; secrets in the environment and in "
                f"outputs are masked)")
