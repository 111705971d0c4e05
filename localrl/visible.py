"""Text from a model, a command's output or a file, made safe to show on a terminal: every character that
would act on the terminal or hide from the reader instead of being seen is written out.

A terminal obeys what it is sent: an escape sequence moves the cursor and erases what was printed, a carriage
return prints over the line, a right-to-left override reverses what follows, a zero-width character is there
and is not seen. A model that writes them can show a person one command and have them approve another. So
every piece of such text reaches the terminal (the CLI's agent and chat, the TUI's transcript and approval
panel) through ``visible``, and a command holding any of them is never approved without asking
(``localrl.agent.approvals``).

How each is shown: C0 and C1 controls and DEL as ``\\xNN`` (``\\x1b`` for ESC, ``\\r`` for a carriage return),
spaces other than the plain one (bash does not split words at them), format characters (bidi overrides and isolates, zero-width spaces and joiners, the byte-order mark, ...), line
and paragraph separators, surrogates, private-use and unassigned code points as ``<U+XXXX>``. New lines and
tabs stay as they are in prose and output (they only move forward); in a command (``command=True``) a tab is
written out and a new line kept, so a command of several lines is shown as several lines.
"""

from __future__ import annotations

import unicodedata

HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
NAMED = {"\r": "\\r", "\n": "\\n", "\t": "\\t", "\x1b": "\\x1b"}


def hidden(ch: str) -> bool:
    """Whether ``ch`` acts on a terminal or cannot be seen (new line and tab included); a space other than
    the plain one counts, as bash does not split words at it."""
    category = unicodedata.category(ch)
    return category in HIDDEN_CATEGORIES or category == "Zs" and ch != " "


def shown_as(ch: str) -> str:
    if ch in NAMED:
        return NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0xA0 else f"<U+{code:04X}>"


def visible(text: str, command: bool = False) -> str:
    """``text`` with every hidden character written out but new lines and (unless ``command``) tabs."""
    keep = "\n" if command else "\n\t"
    if not any(hidden(ch) and ch not in keep for ch in text):  # the common case: nothing to do
        return text
    return "".join(shown_as(ch) if hidden(ch) and ch not in keep else ch for ch in text)


def hidden_in_command(command: str) -> list[str]:
    """How each distinct hidden character in ``command`` is shown, in order of first appearance; a new line is
    not counted (it separates commands, which the approval rules read), a tab neither."""
    found: dict[str, None] = {}
    for ch in command:
        if ch not in "\n\t" and hidden(ch):
            found.setdefault(shown_as(ch))
    return list(found)
