"""A command line as bash would run it, or the reason it cannot be told for sure: what the approval rules read.

A rule such as "always allow ``ls``" is only as good as the reading of the line it is matched against. Python's
``shlex`` is not bash: it takes ``#`` inside a word for a comment, turns nothing into a new line and knows no
``$'...'`` quoting, so ``ls x#; touch P`` looked like one ``ls``. This is a strict reader of a subset of bash's
grammar: simple commands joined by ``;``, ``&&``, ``||``, ``|``, ``|&``, ``&`` and new lines, their words
with single quotes, double quotes and backslash escapes removed as bash removes them, and their redirections.
Whatever it does not model it refuses, naming it, and the line is asked about: comments, ``$'...'`` and ``$"..."``,
``${...}``, command, process and arithmetic substitution, backticks, here-documents and here-strings, a
backslash before a new line, subshells and groups, reserved words (``if``, ``for``, ``{``, ``time``, ...) where
a command would start, variable assignments, a command name that expands (``$X``, globs, ``~``, braces), and
redirection to a file outside the working directory (an absolute path other than ``/dev/null``, ``..``, ``~``)
or to a name that expands.

``$NAME``, ``$1``, ``$?``, globs and braces inside arguments are kept as written: bash expands them, but an
expansion's result is never read as syntax again, so it cannot start another command. The tests hold this
reader to bash itself: each line is run by bash with every command traced instead of run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SEPARATORS = ("&&", "||", "|&", "|", "&", ";", "\n")  # longest first
CASE_ENDINGS = (";;&", ";;", ";&")
REDIRECTIONS = ("&>>", "&>", ">>", ">&", "<&", "<>", ">|", ">", "<")  # longest first; here-docs are refused
RESERVED = frozenset({"!", "if", "then", "else", "elif", "fi", "case", "esac", "for", "select", "while", "until",
                      "do", "done", "in", "function", "time", "coproc", "{", "}", "[[", "]]"})
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SPECIAL_PARAMETERS = set("0123456789?#@*$!-")
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?=")
DOUBLE_QUOTED_ESCAPES = set('$`"\\')


class Unsure(ValueError):
    """A line this reader does not model; its message says what (``a comment``, ``command substitution``)."""


@dataclass
class SimpleCommand:
    words: list[str] = field(default_factory=list)  # after quote removal; expansions kept as written
    expands: list[bool] = field(default_factory=list)  # per word: whether bash will expand it
    redirections: list[tuple[str, str]] = field(default_factory=list)  # (operator with its fd, target)


@dataclass
class _Word:
    text: list[str] = field(default_factory=list)
    started: bool = False
    quoted: bool = False
    expands: bool = False


def simple_commands(line: str) -> list[SimpleCommand]:
    """The line's simple commands in order, or ``Unsure`` naming the first thing it does not model."""
    commands: list[SimpleCommand] = []
    current = SimpleCommand()
    word = _Word()
    pending: str | None = None  # a redirection waiting for its target
    last = ""  # the last separator
    i, n = 0, len(line)

    def end_word() -> None:
        nonlocal word, pending
        if not word.started:
            return
        text = "".join(word.text)
        if pending is not None:
            current.redirections.append((pending, _redirect_target(pending, text, word)))
            pending = None
        else:
            current.words.append(text)
            current.expands.append(word.expands)
        word = _Word()

    def end_command(separator: str) -> None:
        nonlocal current, last
        end_word()
        if pending is not None:
            raise Unsure(f"a redirection with no target before {separator!r}")
        if not current.words and not current.redirections:
            if separator == "end" and last in ("&&", "||", "|", "|&"):
                raise Unsure(f"a line that ends in {last!r}")
            if separator == "\n" or (separator == "end" and commands):
                return  # blank lines, a new line after && or |, and a line's end add nothing
            raise Unsure(f"an empty command before {separator!r}")
        _check_command(current)
        commands.append(current)
        current, last = SimpleCommand(), separator

    while i < n:
        ch = line[i]
        if ch in " \t":
            end_word()
            i += 1
        elif ch == "#" and not word.started:
            raise Unsure("a comment")
        elif ch == "\\":
            if i + 1 >= n:
                raise Unsure("a backslash at the end")
            if line[i + 1] == "\n":
                raise Unsure("a backslash before a new line")
            word.started = word.quoted = True
            word.text.append(line[i + 1])
            i += 2
        elif ch == "'":
            close = line.find("'", i + 1)
            if close < 0:
                raise Unsure("an unclosed quote")
            word.started = word.quoted = True
            word.text.append(line[i + 1:close])
            i = close + 1
        elif ch == '"':
            i = _double_quoted(line, i + 1, word)
        elif ch == "$":
            i = _dollar(line, i, word)
        elif ch == "`":
            raise Unsure("command substitution (backticks)")
        elif ch in "()":
            raise Unsure("process substitution" if i and line[i - 1] in "<>" else "a subshell or function")
        elif ch in "<>" or (ch == "&" and line.startswith(("&>", "&>>"), i)):
            if line.startswith(("<<", "<(", ">("), i):
                raise Unsure("a here-document or here-string" if line.startswith("<<", i) else "process substitution")
            op = next(op for op in REDIRECTIONS if line.startswith(op, i))
            fd = ""
            if word.started and not word.quoted and not word.expands and "".join(word.text).isdigit():
                fd, word = "".join(word.text), _Word()  # 2>file: digits right before it are the descriptor
            elif word.started and re.fullmatch(r"\{[A-Za-z_][A-Za-z0-9_]*\}", "".join(word.text)):
                raise Unsure("a redirection to a named descriptor")
            end_word()
            if pending is not None:
                raise Unsure("a redirection with no target")
            i += len(op)
            if op in (">&", "<&") and line.startswith("-", i):  # bash reads <&- as closing, whatever follows the -
                current.redirections.append((fd + op, "-"))
                i += 1
            else:
                pending = fd + op
        elif ch in ";&|\n":
            if ending := next((op for op in CASE_ENDINGS if line.startswith(op, i)), None):
                raise Unsure(f"{ending!r} outside a case")
            op = next(op for op in SEPARATORS if line.startswith(op, i))
            end_command(op)
            i += len(op)
        else:
            word.started = True
            if ch in "*?[{~":
                word.expands = True
            word.text.append(ch)
            i += 1
    end_command("end")
    return commands


def _double_quoted(line: str, i: int, word: _Word) -> int:
    """Read a double-quoted part from ``i`` (after its quote) into ``word``; the index after its closing quote."""
    word.started = word.quoted = True
    n = len(line)
    while i < n:
        ch = line[i]
        if ch == '"':
            return i + 1
        if ch == "`":
            raise Unsure("command substitution (backticks)")
        if ch == "\\" and i + 1 < n and line[i + 1] == "\n":
            raise Unsure("a backslash before a new line")
        if ch == "\\" and i + 1 < n and line[i + 1] in DOUBLE_QUOTED_ESCAPES:
            word.text.append(line[i + 1])
            i += 2
        elif ch == "$":
            i = _dollar(line, i, word, quoted=True)
        else:
            word.text.append(ch)
            i += 1
    raise Unsure("an unclosed quote")


def _dollar(line: str, i: int, word: _Word, quoted: bool = False) -> int:
    """Read what a ``$`` at ``i`` starts into ``word``; the index after it."""
    nxt = line[i + 1] if i + 1 < len(line) else ""
    if nxt == "(":
        raise Unsure("command or arithmetic substitution")
    if nxt == "{":
        raise Unsure("a ${...} expansion")
    if nxt == "[":
        raise Unsure("arithmetic expansion")
    if nxt in ("'", '"') and not quoted:
        raise Unsure(f"{'$' + nxt}...{nxt} quoting")
    word.started = True
    if m := NAME.match(line, i + 1):
        word.expands = True
        word.text.append(line[i:m.end()])
        return m.end()
    if nxt and nxt in SPECIAL_PARAMETERS:
        word.expands = True
        word.text.append(line[i:i + 2])
        return i + 2
    word.text.append("$")  # a lone dollar is itself
    return i + 1


def _redirect_target(op: str, target: str, word: _Word) -> str:
    """``target`` if a redirection ``op`` to it stays in the working directory, else ``Unsure``."""
    if word.expands:
        raise Unsure(f"a redirection to a name that expands ({target})")
    if op.endswith((">&", "<&")):
        if target.isdigit() or target == "-":
            return target  # another descriptor, or closing one
        if op not in (">&", "<&"):
            raise Unsure(f"a descriptor's redirection to a name ({op}{target})")
    if target == "/dev/null":
        return target
    if target.startswith("/") or target == ".." or target.startswith("../") or "/../" in target \
            or target.endswith("/.."):
        raise Unsure(f"a redirection outside the working directory ({target})")
    if target == "":
        raise Unsure("a redirection to an empty name")
    return target


def _check_command(command: SimpleCommand) -> None:
    if not command.words:
        return  # redirections alone (`> file`): they only create or truncate a file in the working directory
    first = command.words[0]
    if first in RESERVED:
        raise Unsure(f"the reserved word {first!r}")
    if ASSIGNMENT.match(first):
        raise Unsure("a variable assignment")
    if command.expands[0]:
        raise Unsure(f"a command name that expands ({first})")
