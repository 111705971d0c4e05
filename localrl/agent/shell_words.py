"""A shell command line as words and operators, with where each stands in the line: what the scripted person
(``scripted_person``) and the edits learned from a person (``edit_rules``) read and rewrite. Not a shell parser:
enough to find a simple command's tool and its options without changing a quoted part.
"""

from __future__ import annotations

import re

OPERATOR = re.compile(r"\|\||&&|;;|>>|<<|[|;&<>()]")
REDIRECT = {">", ">>", "<", "<<"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def shell_words(line: str) -> list[tuple[int, int, str, bool]]:
    """The line's words and operators: (start, end, text, is_operator); a quoted or escaped part stays in its word
    (an unclosed quote runs to the end of the line)."""
    out, i, n = [], 0, len(line)
    while i < n:
        if line[i].isspace():
            i += 1
            continue
        if m := OPERATOR.match(line, i):
            out.append((i, m.end(), m.group(), True))
            i = m.end()
            continue
        start = i
        while i < n and not line[i].isspace() and not OPERATOR.match(line, i):
            if line[i] in "'\"":
                close = line.find(line[i], i + 1)
                i = n if close < 0 else close + 1
            else:
                i += 2 if line[i] == "\\" else 1
        out.append((start, min(i, n), line[start:i], False))
    return out


def tools(words: list[tuple[int, int, str, bool]]) -> list[str | None]:
    """For each of ``words``, the tool of the simple command it is in (the command's first word that is no variable
    assignment, its directory dropped); None for an operator and the words before a command's tool."""
    out, tool, after_redirect = [], None, False
    for _, _, text, operator in words:
        if operator:
            after_redirect = text in REDIRECT
            if not after_redirect:
                tool = None
            out.append(None)
            continue
        if after_redirect:  # a redirection's file is no tool
            after_redirect = False
        elif tool is None and not ASSIGNMENT.match(text):
            tool = text.rsplit("/", 1)[-1]
        out.append(tool)
    return out
