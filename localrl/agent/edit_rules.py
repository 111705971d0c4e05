"""What a person's edits say about the commands they want, learned from their recorded sessions: a model of the
person at the approval prompt.

Each edit (``decision: edited`` in a session log, ``session_log``) is read as a word-level diff of the command as
proposed and as the person let it run (``difflib`` on ``shell_words``), and every change becomes a rule:

- words put before the whole line (``timeout 10`` in front of ``wc -l < a.txt``): a prefix every line gets;
- any other change: in a simple command of that tool, these words become those (``wc``: ``-l`` -> ``--lines``). A
  word inserted is kept with the word before it (``rm``: ``rm`` -> ``rm -i``); a removed or replaced word that is no
  option and reappears inside the edit is a slot that matches any word (``head``: ``-n 3`` -> ``--lines=3`` is
  ``-n X`` -> ``--lines=X``).

Approvals are evidence too: a rule that would have changed a command the person approved as proposed is dropped
(the person does not hold it). ``EditRules.apply`` is the learned person's edit of a new command (the rules in the
order learned, each where it matches, never twice in a row); ``approves`` whether they would let it run unchanged.
A person's rules the edits never showed (a tool they never saw edited) are not known; the learned person approves
what it has no rule about.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from localrl.agent.session_log import FILE as SESSIONS
from localrl.agent.shell_words import shell_words, tools
from localrl.errors import UserError

SLOT = "\x00"  # a rule's word that matches any word (then "\x00" + its number)


@dataclass(frozen=True)
class Rule:
    tool: str | None  # the simple command's tool it applies in; None: the line's start (a prefix)
    before: tuple[str, ...]  # the words it changes (slots match any word)
    after: tuple[str, ...]  # what they become (slots: the words they matched)

    def describe(self) -> str:
        show = lambda ws: re.sub(f"{SLOT}[0-9]+", "X", " ".join(ws))  # noqa: E731
        if self.tool is None:
            return f"every line starts with {show(self.after)!r}"
        return f"{self.tool}: {show(self.before)!r} -> {show(self.after)!r}"


def _slotted(before: list[str], after: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``before``'s words that are no option and reappear inside ``after`` as slots, in both."""
    before, after = list(before), list(after)
    for i, word in enumerate(before):
        if word.startswith("-") or word.startswith(SLOT) or not any(word in w for w in after):
            continue
        slot = f"{SLOT}{i}"
        before[i] = slot
        after = [w.replace(word, slot) for w in after]
    return tuple(before), tuple(after)


def rules_of_edit(proposed: str, edited: str) -> list[Rule]:
    """The rules one edit shows: each change of the word-level diff from ``proposed`` to ``edited``."""
    old, new = shell_words(proposed), shell_words(edited)
    a, b, tool_of = [w[2] for w in old], [w[2] for w in new], tools(old)
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag == "insert" and i1 == 0:
            out.append(Rule(None, (), tuple(b[j1:j2])))
            continue
        if tag == "insert":  # kept with the word before it (as it is: no slot)
            tool = tool_of[i1 - 1]
            if tool is not None:
                out.append(Rule(tool, (a[i1 - 1],), (a[i1 - 1], *b[j1:j2])))
            continue
        tool = tool_of[i1] or next((t for t in tool_of[i1:i2] if t), None)
        if tool is not None:  # (else an operator's change, outside any command)
            out.append(Rule(tool, *_slotted(a[i1:i2], b[j1:j2])))
    return out


def _match(rule: Rule, words: list[str], at: int) -> dict[str, str] | None:
    """The slots' words if ``rule.before`` matches ``words`` from ``at``, else None."""
    if at + len(rule.before) > len(words):
        return None
    bound = {}
    for want, word in zip(rule.before, words[at:at + len(rule.before)]):
        if want.startswith(SLOT):
            if bound.setdefault(want, word) != word:
                return None
        elif want != word:
            return None
    return bound


def _fill(words: tuple[str, ...], bound: dict[str, str]) -> list[str]:
    out = []
    for word in words:
        for slot, value in bound.items():
            word = word.replace(slot, value)
        out.append(word)
    return out


def apply_rule(rule: Rule, line: str) -> str:
    """``line`` with ``rule`` applied where it matches (and where the words are not already its result)."""
    ws = shell_words(line)
    texts, tool_of = [w[2] for w in ws], tools(ws)
    if rule.tool is None:
        if texts[:len(rule.after)] == list(rule.after):
            return line
        return f"{' '.join(rule.after)} {line.strip()}"
    edits, k = [], 0
    while k < len(ws):
        bound = _match(rule, texts, k) if tool_of[k] == rule.tool and not ws[k][3] else None
        if bound is None or any(tool_of[j] != rule.tool for j in range(k, k + len(rule.before))):
            k += 1
            continue
        result = _fill(rule.after, bound)
        if texts[k:k + len(result)] != result:  # already the rule's form: left (an inserted word is not doubled)
            edits.append((ws[k][0], ws[k + len(rule.before) - 1][1], " ".join(result)))
        k += max(len(rule.before), 1)
    for start, end, text in reversed(edits):
        line = line[:start] + text + line[end:]
    return line


@dataclass
class EditRules:
    rules: list[Rule]
    edits: int = 0  # the edits they were learned from
    approvals: int = 0  # the approved commands they were checked against
    dropped: int = 0  # rules an approval contradicted

    @classmethod
    def learn(cls, decisions: list[tuple[str, str | None]]) -> "EditRules":
        """Rules from ``(proposed, edited)`` decisions (``edited`` None: approved as proposed), each edit's rules in
        order of first appearance, less those an approved command contradicts."""
        rules, approved, edits = {}, [], 0
        for proposed, edited in decisions:
            if edited is None or edited == proposed:
                approved.append(proposed)
                continue
            edits += 1
            for rule in rules_of_edit(proposed, edited):
                rules.setdefault(rule, None)
        kept = [r for r in rules if all(apply_rule(r, c) == c for c in approved)]
        return cls(kept, edits, len(approved), len(rules) - len(kept))

    @classmethod
    def from_sessions(cls, source: str | Path) -> "EditRules":
        """Rules from a session log (a directory holding ``sessions.jsonl``, or the file): its edited and approved
        commands (rejections and remembered rules' decisions say nothing about an edit's form)."""
        from localrl.data.jsonl import json_objects

        path = Path(source)
        path = path / SESSIONS if path.is_dir() else path
        if not path.is_file():
            raise UserError(f"{source}: no recorded sessions (a directory holding {SESSIONS}, as localrl agent "
                            f"--record writes, or such a file)")
        decisions = []
        for where, record in json_objects(path, "sessions"):
            turns = record.get("turns") or []
            if not isinstance(turns, list):
                raise UserError(f"{where}: a session's 'turns' must be a list (not a session log?)")
            for turn in turns:
                if not isinstance(turn, dict) or not isinstance(turn.get("proposed"), str):
                    raise UserError(f"{where}: a turn without the command it 'proposed' (not a session log?)")
                if turn.get("decision") == "approved":
                    decisions.append((turn["proposed"], None))
                elif turn.get("decision") == "edited" and isinstance(turn.get("command"), str):
                    decisions.append((turn["proposed"], turn["command"]))
        return cls.learn(decisions)

    def apply(self, command: str) -> str:
        """The learned person's edit of ``command`` (``command`` itself where no rule changes it)."""
        for rule in self.rules:
            command = apply_rule(rule, command)
        return command

    def approves(self, command: str) -> bool:
        return self.apply(command) == command

    def describe(self) -> str:
        plural = lambda n, word: f"{n} {word}{'' if n == 1 else 's'}"  # noqa: E731
        return (f"{plural(len(self.rules), 'rule')} from {plural(self.edits, 'edit')} ({self.dropped} dropped: an "
                f"approved command broke them)")
