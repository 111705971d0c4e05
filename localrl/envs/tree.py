"""A working directory's tree as a hostile command may have left it: walked, measured, disarmed and removed
without recursion, without a path string, and without following anything that can be swapped.

What a command can leave: a tree 100,000 directories deep (a recursive walk dies of RecursionError, a path
string passes PATH_MAX and the walk skips what is below it), directories made unreadable (``chmod 000``), and,
while the walk runs, a directory swapped for a link to a host file (a ``chmod`` by path would follow it).

So the walk holds one directory open at a time and goes down by name relative to it (``O_NOFOLLOW``: a link
is never entered) and back up through ``..``, checking that ``..`` is the directory it came from (a directory
moved meanwhile ends the walk with ``Moved``). A directory the walker may not read, it makes readable through a
handle that pins the directory itself (``O_PATH``, then ``chmod`` of ``/proc/self/fd/N``), never through its
name. Depth costs neither file descriptors nor stack.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
PIN_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OVER = 2**62  # a size that is over any quota: what cannot be measured counts as too much
# visit(dir_fd, name, lstat of the entry, the path of its directory below the root: "" or "a/b/"): every entry
Visit = Callable[[int, str, os.stat_result, str], None]


class Moved(OSError):
    """A directory of the tree moved while it was walked."""


class Unreadable(OSError):
    """A directory that could not be made readable."""


def _open_child(fd: int, name: str, make_readable: bool) -> int | None:
    """The directory ``name`` in ``fd``, opened for reading; None if it is gone or no longer a directory (a link
    put in its place is not followed)."""
    try:
        return os.open(name, OPEN_DIR, dir_fd=fd)
    except PermissionError:
        if not make_readable:
            raise Unreadable(f"cannot read the directory {name!r}") from None
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link now stands in its place
            return None
        raise
    try:  # hidden from us (chmod 000) by a command of our own user: pin the directory, then change it
        pin = os.open(name, PIN_DIR, dir_fd=fd)
    except OSError:
        return None
    try:
        mode = stat.S_IMODE(os.fstat(pin).st_mode)
        os.chmod(f"/proc/self/fd/{pin}", mode | 0o700)  # the magic link is the pinned directory, not a name
        return os.open(f"/proc/self/fd/{pin}", OPEN_DIR & ~os.O_NOFOLLOW)
    except OSError as e:
        raise Unreadable(f"cannot make the directory {name!r} readable: {e}") from None
    finally:
        os.close(pin)


def _entries(fd: int, where: str, visit: Visit) -> list[str]:
    """Visit each entry of the open directory ``fd`` (at ``where`` below the root); its subdirectories' names."""
    with os.scandir(fd) as it:
        names = [e.name for e in it]
    subdirs = []
    for name in names:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        visit(fd, name, st, where)
        if stat.S_ISDIR(st.st_mode):
            subdirs.append(name)
    return subdirs


def walk(root: str | Path, visit: Visit, leave: Callable[[int, str], None] | None = None,
         make_readable: bool = True) -> None:
    """Call ``visit`` for every entry below ``root`` (a directory before what is in it) and ``leave(parent_fd,
    name)`` after a directory's contents (to remove it). Raises ``Moved`` if a directory moved meanwhile,
    ``Unreadable`` if one cannot be read, OSError if ``root`` cannot be opened."""
    fd = os.open(root, OPEN_DIR)
    try:
        top = os.fstat(fd)
        ids = [(top.st_dev, top.st_ino)]  # the directories from the root down to the one open
        names: list[str] = []
        todo = [_entries(fd, "", visit)]  # per level: the subdirectories still to walk
        while todo:
            if todo[-1]:
                name = todo[-1].pop()
                child = _open_child(fd, name, make_readable)
                if child is None:
                    continue
                os.close(fd)
                fd = child
                st = os.fstat(fd)
                ids.append((st.st_dev, st.st_ino))
                names.append(name)
                todo.append(_entries(fd, "".join(n + "/" for n in names), visit))
                continue
            todo.pop()
            if not names:
                break
            parent = os.open("..", OPEN_DIR, dir_fd=fd)
            st = os.fstat(parent)
            ids.pop()
            if (st.st_dev, st.st_ino) != ids[-1]:
                os.close(parent)
                raise Moved(f"a directory moved while {root} was walked")
            os.close(fd)
            fd = parent
            name = names.pop()
            if leave is not None:
                leave(fd, name)
    finally:
        os.close(fd)


def allocated_bytes(root: str | Path, seen: set[tuple[int, int]] | None = None, tries: int = 3) -> int:
    """Bytes allocated under ``root``, each file once however many names it has (added to ``seen``); ``OVER`` if
    a directory cannot be made readable, or keeps moving while it is measured."""
    for _ in range(tries):
        total, found = 0, set()

        def visit(fd: int, name: str, st: os.stat_result, where: str) -> None:
            nonlocal total
            if (st.st_dev, st.st_ino) not in found:
                found.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512

        try:
            walk(root, visit)
        except Moved:
            continue
        except FileNotFoundError:
            return 0
        except OSError:
            return OVER
        if seen is not None:
            seen |= found
        return total
    return OVER


def remove_tree(root: str | Path, tries: int = 3) -> bool:
    """Remove ``root`` and everything under it; whether it is gone. Never raises."""
    def visit(fd: int, name: str, st: os.stat_result, where: str) -> None:
        if not stat.S_ISDIR(st.st_mode):
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass

    def leave(fd: int, name: str) -> None:
        try:
            os.rmdir(name, dir_fd=fd)
        except OSError:
            pass  # not empty (a file it could not remove): the root's rmdir below says so

    for _ in range(tries):
        try:
            walk(root, visit, leave)
            os.rmdir(root)
            return True
        except FileNotFoundError:
            return not os.path.lexists(root)
        except OSError as e:
            if e.errno in (errno.ENOTDIR, errno.ELOOP):  # a file or a link in the directory's place: its name only
                try:
                    os.unlink(root)
                    return True
                except OSError:
                    return False
    return not os.path.lexists(root)


def remove_stale(folder: str | Path, prefix: str, owner: int | None = None,
                 remove: Callable[[Path], object] = remove_tree) -> None:
    """Remove (with ``remove``) the directories ``folder/PREFIX{pid}-*`` whose process is gone (killed before it
    could remove them), only those owned by ``owner`` if given. Never raises: what cannot be removed stays."""
    try:
        found = list(Path(folder).glob(f"{prefix}*-*"))
    except OSError:
        return
    for path in found:
        pid = path.name[len(prefix):].split("-")[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        if owner is not None:
            try:
                st = path.lstat()
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != owner:
                continue
        remove(path)
