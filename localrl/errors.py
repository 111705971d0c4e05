"""The one exception type for mistakes a user can make (bad path, bad config, malformed data).

The CLI prints its message as a single line and exits with status 2; everything else
is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, stated in one line that names what and where."""
