"""Which commands an agent may run without asking: prefixes the user allowed or denied for a working
directory, remembered across sessions, and patterns that are always asked about.

A command line is read as bash reads it (``bash_syntax``: a strict reader that names what it does not model,
comments, ``$'...'``, substitutions, here-documents and more, and the line is then asked about). It runs
without asking only if every simple command starts with an allowed prefix (word by word: allowing ``git status``
allows ``git status -s``, not ``git push``); it is refused if any starts with a denied prefix (deny wins);
anything else is asked about, and so, every time, is a line holding a character that acts on a terminal or
cannot be seen (``localrl.visible``), a dangerous one (``sudo``, a recursive ``rm`` of a path outside the
working directory, a download piped into a shell, disk and permission wrecking) and one that runs text as
commands (``eval``, ``source``).

Decisions live in ``$XDG_DATA_HOME/localrl/approvals.json`` (``~/.local/share`` by default),
keyed by the working directory's resolved path, written atomically.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from localrl.agent.bash_syntax import Unsure, simple_commands
from localrl.atomic import write_text_atomic
from localrl.visible import hidden_in_command

RUNS_TEXT = frozenset({"eval", "source", ".", "exec", "builtin", "command", "enable", "trap"})
DANGEROUS = [
    (re.compile(r"(^|[\s;&|(])sudo\b|(^|[\s;&|(])su\s"), "runs as another user"),
    (re.compile(r"\brm\b[^;&|]*\s-\w*[rR]\w*\b[^;&|]*\s(/|~|\.\.)"), "removes a tree outside the working directory"),
    (re.compile(r"\brm\b[^;&|]*\s(/|~|\.\.)[^;&|]*\s-\w*[rR]"), "removes a tree outside the working directory"),
    (re.compile(r"\b(curl|wget|fetch)\b[^;&]*\|\s*(sudo\s+)?(ba|z|da|k)?sh\b"), "pipes a download into a shell"),
    (re.compile(r"\bmkfs|\bdd\b[^;&|]*\bof=/dev/|>\s*/dev/(sd|nvme|hd)"), "writes to a disk device"),
    (re.compile(r":\(\)\s*\{"), "a fork bomb"),
    (re.compile(r"\bchmod\b[^;&|]*\s-\w*R\w*[^;&|]*\s/|\bchown\b[^;&|]*\s-\w*R\w*[^;&|]*\s/"), "changes permissions "
                                                                                             "outside the working "
                                                                                             "directory"),
]


def danger(line: str) -> str | None:
    """Why ``line`` must always be asked about, if it must."""
    return next((why for pattern, why in DANGEROUS if pattern.search(line)), None)


def _store_path() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "localrl" / "approvals.json"


class Approvals:
    def __init__(self, workdir: str | Path, store: str | Path | None = None):
        self.workdir = str(Path(workdir).expanduser().resolve())
        self.store = Path(store) if store else _store_path()
        saved = self._load().get(self.workdir, {})
        self.allowed: list[list[str]] = [list(p) for p in saved.get("allow", [])]
        self.denied: list[list[str]] = [list(p) for p in saved.get("deny", [])]

    def _load(self) -> dict:
        try:
            data = json.loads(self.store.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def decide(self, line: str) -> tuple[str, str]:
        """("allow" | "deny" | "ask", why in words) for a command line."""
        if hidden := hidden_in_command(line):
            return "ask", f"WARNING: it holds characters that act on a terminal or cannot be seen, shown as " \
                          f"{' '.join(hidden)}"
        if why := danger(line):
            return "ask", why
        try:
            commands = [c.words for c in simple_commands(line)]
        except Unsure as e:
            return "ask", f"bash would read {e}, which is asked about every time"
        if not all(commands):
            return "ask", "it only redirects"
        if runs_text := next((words[0] for words in commands if words[0] in RUNS_TEXT), None):
            return "ask", f"`{runs_text}` runs text as commands"
        for words in commands:
            if prefix := _matching(words, self.denied):
                return "deny", f"you always deny `{' '.join(prefix)}` here"
        prefixes = [_matching(words, self.allowed) for words in commands]
        if all(prefixes):
            return "allow", "you always allow " + ", ".join(f"`{' '.join(p)}`" for p in prefixes) + " here"
        return "ask", "not yet allowed here"

    def remember(self, prefix: str, allow: bool) -> None:
        """Always allow (or deny) commands starting with ``prefix`` in this working directory."""
        try:
            commands = simple_commands(prefix)
        except Unsure:
            return
        if len(commands) != 1 or commands[0].redirections or any(commands[0].expands):
            return
        words = commands[0].words
        (self.allowed if allow else self.denied).append(words)
        data = self._load()
        data[self.workdir] = {"allow": self.allowed, "deny": self.denied}
        self.store.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.store, json.dumps(data, indent=1) + "\n")


def _matching(words: list[str], prefixes: list[list[str]]) -> list[str] | None:
    return next((p for p in prefixes if words[:len(p)] == p), None)
