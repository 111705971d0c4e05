"""A scripted person at the approval prompt, for measuring what an agent learns from someone's decisions.

``ScriptedPerson.ask`` stands where a person answers ``run_agent``'s prompt: it approves a command its hidden rule
allows and edits one the rule does not allow into the allowed form, counting both. Two rules a real person might well
hold and never say (``RULES``):

- ``timeout``: **every command under a time limit** (``timeout 10 wc -l < a.txt``), so nothing the agent starts
  can hang the session; ``under_timeout`` prefixes a line that does not start with ``timeout``.
- ``long-options``: **options spelt long** (``wc --lines``, never ``wc -l``), so what ran reads plainly in the shell
  history later. ``long_options`` spells every short option of a known tool that has a long spelling the long way
  (``-l`` -> ``--lines``, ``-d, -f2`` -> ``--delimiter=, --fields=2``, ``-rf`` -> ``--recursive --force``); a word
  holding any letter without a long spelling (``ls -la``), a quoted word, what follows ``--``, a redirection's file
  and tools not in the table are left as they are.

Either edit changes form only: the command does what it did (a test runs every built-in task's expert commands both
ways in the sandbox).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from localrl.agent.shell_words import ASSIGNMENT, REDIRECT, shell_words

# tool -> {short letter: (long name, argument)}; argument: "" none, "next" (attached or the next word),
# "attached" (only if attached, as sed's -i SUFFIX)
_COMMON_FILE_OPTIONS = {"f": ("force", ""), "i": ("interactive", ""), "v": ("verbose", "")}
LONG_OPTIONS: dict[str, dict[str, tuple[str, str]]] = {
    "wc": {"l": ("lines", ""), "w": ("words", ""), "c": ("bytes", ""), "m": ("chars", ""),
           "L": ("max-line-length", "")},
    "grep": {"c": ("count", ""), "i": ("ignore-case", ""), "v": ("invert-match", ""), "n": ("line-number", ""),
             "r": ("recursive", ""), "l": ("files-with-matches", ""), "L": ("files-without-match", ""),
             "o": ("only-matching", ""), "w": ("word-regexp", ""), "x": ("line-regexp", ""),
             "E": ("extended-regexp", ""), "F": ("fixed-strings", ""), "q": ("quiet", ""), "s": ("no-messages", ""),
             "h": ("no-filename", ""), "H": ("with-filename", ""), "e": ("regexp", "next"), "m": ("max-count", "next"),
             "A": ("after-context", "next"), "B": ("before-context", "next"), "C": ("context", "next")},
    "sed": {"i": ("in-place", "attached"), "n": ("quiet", ""), "E": ("regexp-extended", ""),
            "r": ("regexp-extended", ""), "s": ("separate", ""), "e": ("expression", "next")},
    "head": {"n": ("lines", "next"), "c": ("bytes", "next"), "q": ("quiet", "")},
    "tail": {"n": ("lines", "next"), "c": ("bytes", "next"), "q": ("quiet", ""), "f": ("follow", "")},
    "cut": {"d": ("delimiter", "next"), "f": ("fields", "next"), "c": ("characters", "next"), "b": ("bytes", "next"),
            "s": ("only-delimited", "")},
    "sort": {"u": ("unique", ""), "n": ("numeric-sort", ""), "r": ("reverse", ""), "f": ("ignore-case", ""),
             "h": ("human-numeric-sort", ""), "V": ("version-sort", ""), "s": ("stable", ""),
             "t": ("field-separator", "next"), "k": ("key", "next"), "o": ("output", "next")},
    "uniq": {"c": ("count", ""), "d": ("repeated", ""), "u": ("unique", ""), "i": ("ignore-case", "")},
    "mkdir": {"p": ("parents", ""), "v": ("verbose", ""), "m": ("mode", "next")},
    "mv": {**_COMMON_FILE_OPTIONS, "n": ("no-clobber", ""), "u": ("update", ""), "t": ("target-directory", "next"),
           "T": ("no-target-directory", "")},
    "cp": {**_COMMON_FILE_OPTIONS, "n": ("no-clobber", ""), "r": ("recursive", ""), "R": ("recursive", ""),
           "a": ("archive", ""), "u": ("update", ""), "t": ("target-directory", "next"),
           "T": ("no-target-directory", "")},
    "rm": {**_COMMON_FILE_OPTIONS, "r": ("recursive", ""), "R": ("recursive", ""), "d": ("dir", "")},
    "ls": {"a": ("all", ""), "A": ("almost-all", ""), "r": ("reverse", ""), "R": ("recursive", ""),
           "h": ("human-readable", "")},
    "touch": {"c": ("no-create", "")},
    "tr": {"d": ("delete", ""), "s": ("squeeze-repeats", ""), "c": ("complement", "")},
    "cat": {"n": ("number", ""), "A": ("show-all", ""), "E": ("show-ends", "")},
}
def _long_form(word: str, table: dict[str, tuple[str, str]], following: str | None) -> tuple[str, bool] | None:
    """``word``'s options spelt long, and whether the next word (``following``) was its argument; None to leave it."""
    parts, i = [], 1
    while i < len(word):
        spec = table.get(word[i])
        if spec is None:
            return None
        name, argument = spec
        rest = word[i + 1:]
        if argument == "next" or (argument == "attached" and rest):
            if rest:
                return " ".join(parts + [f"--{name}={rest}"]), False
            if following is None:
                return None
            return " ".join(parts + [f"--{name}={following}"]), True
        parts.append(f"--{name}")
        i += 1
    return " ".join(parts), False


def long_options(line: str) -> str:
    """``line`` with every short option of a tool in ``LONG_OPTIONS`` spelt long; a line with none is returned as is."""
    words, edits = shell_words(line), []
    tool, options_end, after_redirect, skip = None, False, False, False
    for k, (start, end, text, operator) in enumerate(words):
        if skip:
            skip = False
            continue
        if operator:
            after_redirect = text in REDIRECT
            if not after_redirect:
                tool, options_end = None, False
            continue
        if after_redirect:  # a redirection's file
            after_redirect = False
            continue
        if tool is None:
            if not ASSIGNMENT.match(text):
                tool = text.rsplit("/", 1)[-1]
            continue
        if text == "--":
            options_end = True
        if options_end or tool not in LONG_OPTIONS or not text.startswith("-") or text.startswith("--") or \
                len(text) < 2:
            continue
        following = words[k + 1] if k + 1 < len(words) and not words[k + 1][3] else None
        form = _long_form(text, LONG_OPTIONS[tool], following[2] if following else None)
        if form is not None:
            edits.append((start, following[1] if form[1] else end, form[0]))
            skip = form[1]
    for start, end, text in reversed(edits):
        line = line[:start] + text + line[end:]
    return line


TIME_LIMIT = "timeout 10"


def under_timeout(line: str) -> str:
    """``line`` under ``timeout 10``, unless it already starts with ``timeout``."""
    words = line.split()
    return line if words and words[0] == "timeout" else f"{TIME_LIMIT} {line.strip()}"


RULES = {"timeout": under_timeout, "long-options": long_options}


@dataclass
class ScriptedPerson:
    """Answers ``run_agent``'s approval prompt by ``rule`` (command -> the form the person allows): runs a command the
    rule leaves as it is, runs the rule's edit of any other; counts what it was asked and approved unchanged."""

    rule: Callable[[str], str] = under_timeout
    asked: int = 0
    approved: int = 0

    def ask(self, command: str, why: str) -> tuple[str, str | None]:
        allowed = self.rule(command)
        self.asked += 1
        self.approved += allowed == command
        return "run", allowed

    @property
    def approval_rate(self) -> float:
        return self.approved / self.asked if self.asked else 0.0
