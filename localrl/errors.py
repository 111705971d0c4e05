"""The one exception type for mistakes a user can make (bad path, bad config, malformed data).

The CLI prints its message as a single line and exits with status 2; the terminal UI shows it
under its form and marks the input named by ``field`` (a config field name, or None).
Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import importlib
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path


class UserError(Exception):
    """A problem with the user's input, stated in one line that names what and where."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def first_line(e: BaseException, limit: int | None = None) -> str:
    """An exception's message cut to its first line (at most ``limit`` characters; its type's name where it has no
    message), for a one-line error that quotes it."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line[:limit] if limit else line


def out_of_space(e: BaseException) -> bool:
    """Whether ``e`` says a write found no room: ENOSPC or EDQUOT, or the way numpy ("N requested and M
    written"), torch ("file write failed") and safetensors ("os error 28") report it."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return isinstance(e, OSError) and e.errno is None and "requested and" in text and "written" in text or \
        any(sign in text for sign in ("No space left", "os error 28", "file write failed", "Disk quota exceeded"))


_LIBRARY_PATHS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                       | {str(Path(__file__).parent)})  # Python's, installed packages' and localrl's code


def failure_line(e: BaseException) -> str:
    """A user's code failing, in one line: the exception's type, the first line of its message, and where it was
    raised (file:line; a syntax error's own place)."""
    if isinstance(e, SyntaxError):
        message, where = e.msg, f"{Path(e.filename or '?').name}:{e.lineno}"
    else:
        frames = traceback.extract_tb(e.__traceback__)
        frames = [f for f in frames if not f.filename.startswith(_LIBRARY_PATHS)] or frames  # the user's own line
        message, where = str(e), f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    line = f"{type(e).__name__}: {message}".strip().splitlines()[0]
    return f"{line} ({where})" if where else line


def user_callable(spec: str, what: str, field: str) -> Callable:
    """The function a user names as ``package.module:function`` (``what``: what it is for, in errors; ``field``:
    the config field that names it). A module that cannot be found or lacks the function, or that fails as it
    is imported (a syntax error, an exception, sys.exit), stops the run in one line."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"{what} {spec!r}: cannot import it ({e})", field=field) from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's module, failing at import
        raise UserError(f"{what} {spec!r}: importing {module_name} failed: {failure_line(e)}", field=field) from None
    if not callable(fn):
        raise UserError(f"{what} {spec!r}: not a callable", field=field)
    return fn
