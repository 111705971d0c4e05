"""The one exception type for mistakes a user can make (bad path, bad config, malformed data).

The CLI prints its message as a single line and exits with status 2; the terminal UI shows it
under its form and marks the input named by ``field`` (a config field name, or None).
Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, stated in one line that names what and where."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field
