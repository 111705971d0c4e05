"""The one exception type for mistakes a user can make (bad path, bad config, malformed data).

The CLI prints its message as a single line and exits with status 2; the terminal UI shows it
under its form and marks the input named by ``field`` (a config field name, or None).
Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno


class UserError(Exception):
    """A problem with the user's input, stated in one line that names what and where."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def out_of_space(e: BaseException) -> bool:
    """Whether ``e`` says a write found no room: ENOSPC or EDQUOT, or the way numpy ("N requested and M
    written"), torch ("file write failed") and safetensors ("os error 28") report it."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return isinstance(e, OSError) and e.errno is None and "requested and" in text and "written" in text or \
        any(sign in text for sign in ("No space left", "os error 28", "file write failed", "Disk quota exceeded"))
