"""Reading the working directory an episode's commands left, for its verifier. The model's commands made this tree: a
link may point at a host file (its content would leak into the reward), a FIFO or /proc file may block a read
forever. So nothing is followed, only regular files are read, and never more than READ_LIMIT bytes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

READ_LIMIT = 1 << 20
NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _open_parent(root: Path, relative: str) -> tuple[int, str] | None:
    """An fd of ``relative``'s parent directory inside ``root`` (no link followed) and its last name."""
    *dirs, name = Path(relative).parts
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | NO_FOLLOW)
    except OSError:
        return None
    for part in dirs:
        try:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | NO_FOLLOW, dir_fd=fd)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        fd = inner
    return fd, name


def lstat_inside(root: Path, relative: str) -> os.stat_result | None:
    """``relative``'s own status (a link is a link), or None where it or a parent is missing or a link."""
    opened = _open_parent(root, relative)
    if opened is None:
        return None
    fd, name = opened
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_inside(root: Path, relative: str) -> str | None:
    """The text of a regular file inside ``root`` (one name, not a hard link to a file elsewhere),
    without its final newlines; None for anything else."""
    opened = _open_parent(root, relative)
    if opened is None:
        return None
    parent, name = opened
    try:
        fd = os.open(name, os.O_RDONLY | NO_FOLLOW, dir_fd=parent)
    except OSError:
        return None
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size > READ_LIMIT:
            return None
        return os.read(fd, READ_LIMIT + 1).decode(errors="replace").rstrip("\n")
    except OSError:
        return None
    finally:
        os.close(fd)
