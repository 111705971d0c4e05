"""Which commands an agent may run without asking: prefixes the user allowed or denied for a working
directory, remembered across sessions, and patterns that are always asked about.

A command line is split into its simple commands (at ``;``, ``&&``, ``||``, ``|``, ``&`` and new
lines). It runs without asking only if every simple command starts with an allowed prefix (word
by word: allowing ``git status`` allows ``git status -s``, not ``git push``); it is refused if any
starts with a denied prefix (deny wins); anything else, and anything dangerous (``sudo``, a
recursive ``rm`` of a path outside the working directory, a download piped into a shell, disk
and permission wrecking), or any line whose parts cannot be seen (``$(...)``, backticks, process
substitution, ``eval``), is asked about every time.

Decisions live in ``$XDG_DATA_HOME/localrl/approvals.json`` (``~/.local/share`` by default),
keyed by the working directory's resolved path, written atomically.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

from localrl.atomic import write_text_atomic

OPERATORS = {";", "&&", "||", "|", "&", ";;", "|&", ";&", ";;&"}
OPAQUE = re.compile(r"\$\(|`|<\(|>\(|\beval\b|\bsource\b|(^|\s)\.\s")
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


def simple_commands(line: str) -> list[list[str]] | None:
    """The words of each simple command in ``line``, or None if the line cannot be split safely."""
    if OPAQUE.search(line):
        return None
    lexer = shlex.shlex(line.replace("\n", ";"), posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote
        return None
    commands, current = [], []
    for token in tokens:
        if token in OPERATORS:
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    if current:
        commands.append(current)
    return commands


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
        if why := danger(line):
            return "ask", why
        commands = simple_commands(line)
        if commands is None:
            return "ask", "its parts cannot all be seen"
        if not commands:
            return "ask", "it is empty"
        for words in commands:
            if prefix := _matching(words, self.denied):
                return "deny", f"you always deny `{' '.join(prefix)}` here"
        prefixes = [_matching(words, self.allowed) for words in commands]
        if all(prefixes):
            return "allow", "you always allow " + ", ".join(f"`{' '.join(p)}`" for p in prefixes) + " here"
        return "ask", "not yet allowed here"

    def remember(self, prefix: str, allow: bool) -> None:
        """Always allow (or deny) commands starting with ``prefix`` in this working directory."""
        words = shlex.split(prefix)
        if not words:
            return
        (self.allowed if allow else self.denied).append(words)
        data = self._load()
        data[self.workdir] = {"allow": self.allowed, "deny": self.denied}
        self.store.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.store, json.dumps(data, indent=1) + "\n")


def _matching(words: list[str], prefixes: list[list[str]]) -> list[str] | None:
    return next((p for p in prefixes if words[:len(p)] == p), None)
