"""What a world model of the shell reads and writes: the fixed prompt format of ``--env world:SOURCE``.

A working directory's state is a *tree*: relative path -> text content, with ``"dir/" -> ""`` for an empty
directory (the shape of ``ShellTask.files``). Each command of the sandbox runs in a fresh shell in the working
directory, so the files are all that one command leaves to the next: the world model is asked for one step at a
time, from the state it believes in and the command, and the history of an episode is the state it left.

The question (the user message)::

    Files:
    == notes.txt
    one
    two
    == logs/
    Command: wc -l notes.txt

A file is ``== PATH`` then its lines (``== PATH [no final newline]`` when its text does not end in one); an empty
directory is ``== PATH/``; an empty working directory is ``Files: (none)``.

The answer (the assistant message): the command's output as the agent would see it (the sandbox's: what it
printed, then ``[exit code N]``) between ``<output>`` tags, then the changes to the files: every file written
or created in full, as above, and ``-- PATH`` for each path removed::

    <output>
    2 notes.txt
    [exit code 0]
    </output>

A reply that does not have this shape, or names a path outside the working directory, is not read
(``WorldReplyError``): the environment counts it, never guesses.
"""

from __future__ import annotations

import os
import posixpath
import stat
from pathlib import Path

from localrl.envs.tree import walk

Tree = dict[str, str]  # relative path -> content ("dir/" -> "": an empty directory)

NO_NEWLINE = " [no final newline]"
MAX_PATH = 255
WORLD_SYSTEM = (
    "You simulate a Linux shell. Given the files of a working directory and one command run there, reply with what "
    "the command prints (stdout and stderr) and a line [exit code N], between <output> and </output>; then each file "
    "it creates or changes as a line '== PATH' and its whole new content ('== PATH/' for a new empty directory), and "
    "a line '-- PATH' for each path it removes. Nothing else.")


class WorldReplyError(ValueError):
    """A world model's reply that is not in the format above."""


def render_files(tree: Tree) -> str:
    """The ``== PATH`` blocks of ``tree``, in path order."""
    parts = []
    for path in sorted(tree):
        content = tree[path]
        if path.endswith("/") or content.endswith("\n") or not content:
            parts.append(f"== {path}\n{content}")
        else:
            parts.append(f"== {path}{NO_NEWLINE}\n{content}\n")
    return "".join(parts)


def question(tree: Tree, command: str) -> str:
    """The user message: the files and the command."""
    files = render_files(tree) if tree else "(none)\n"
    return f"Files:\n{files}Command: {command}" if tree else f"Files: {files}Command: {command}"


def messages(tree: Tree, command: str) -> list[dict]:
    """The chat every world model is asked: the format explained (the system message), then the question."""
    return [{"role": "system", "content": WORLD_SYSTEM}, {"role": "user", "content": question(tree, command)}]


def changes(before: Tree, after: Tree) -> tuple[Tree, list[str]]:
    """(entries written: new or changed, removed paths) that take ``before`` to ``after``."""
    written = {p: c for p, c in after.items() if before.get(p) != c}
    return written, sorted(p for p in before if p not in after)


def answer(observation: str, before: Tree, after: Tree) -> str:
    """The assistant message for a step that printed ``observation`` and took ``before`` to ``after``."""
    written, removed = changes(before, after)
    out = observation if observation.endswith("\n") or not observation else observation + "\n"
    return f"<output>\n{out}</output>\n" + render_files(written) + "".join(f"-- {p}\n" for p in removed)


def parse_answer(text: str) -> tuple[str, Tree, list[str]]:
    """(observation, entries written, paths removed) of a world model's reply; ``WorldReplyError`` says what is
    wrong with one that is not in the format."""
    head, sep, rest = text.lstrip().partition("<output>\n")
    if not sep or head:
        raise WorldReplyError("it does not start with <output>")
    observation, sep, rest = rest.partition("</output>")
    if not sep:
        raise WorldReplyError("its <output> is not closed")
    written: Tree = {}
    removed: list[str] = []
    current: str | None = None  # the file whose lines come next
    no_newline = False
    for line in rest.strip("\n").split("\n") if rest.strip() else []:
        if line.startswith("== ") or line.startswith("-- "):
            if current is not None and no_newline:
                written[current] = written[current].removesuffix("\n")
            current, no_newline = None, False
            path = line[3:]
            if line.startswith("-- "):
                removed.append(safe_path(path))
                continue
            if path.endswith(NO_NEWLINE):
                path, no_newline = path[:-len(NO_NEWLINE)], True
            path = safe_path(path)
            written[path] = ""
            current = None if path.endswith("/") else path
        elif current is not None:
            written[current] += line + "\n"
        else:
            raise WorldReplyError(f"a line outside any file: {line[:60]!r}")
    if current is not None and no_newline:
        written[current] = written[current].removesuffix("\n")
    return observation.removesuffix("\n"), written, removed


def safe_path(path: str) -> str:
    """``path`` normalised, or ``WorldReplyError`` for one that would leave the working directory."""
    directory = path.endswith("/")
    if not path.strip():
        raise WorldReplyError("an empty path")
    norm = posixpath.normpath(path.strip())
    if (norm == "." or norm.startswith(("/", "../")) or norm == ".." or "\0" in norm
            or len(norm) > MAX_PATH):
        raise WorldReplyError(f"a path outside the working directory: {path[:60]!r}")
    return norm + "/" if directory else norm


def apply(tree: Tree, written: Tree, removed: list[str]) -> Tree:
    """``tree`` after the changes: each removed path goes with what is under it; a written file's directories are
    no longer empty; a directory emptied keeps its place (``dir/``)."""
    out = dict(tree)
    for path in removed:
        base = path.rstrip("/")
        for p in [p for p in out if p.rstrip("/") == base or p.startswith(base + "/")]:
            del out[p]
        parent = posixpath.dirname(base)
        if parent and not any(p.startswith(parent + "/") for p in out):
            out[parent + "/"] = ""
    for path, content in written.items():
        if path.endswith("/") and any(p.startswith(path) for p in out):
            continue  # a directory that holds something is already there
        out[path] = content
        for parent in _parents(path.rstrip("/")):
            out.pop(parent + "/", None)
    return out


def _parents(path: str) -> list[str]:
    parts = path.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


READ_LIMIT = 1 << 20  # bytes read of one file, as the reward check reads them


def read_tree(root: Path) -> Tree:
    """The tree of the real directory ``root``: its regular files (as text, each up to ``READ_LIMIT`` bytes) and
    empty directories; anything else (links, FIFOs) is left out, as a world model cannot see it. At any depth,
    following no link (``tree.walk``): a command's tree is read as the sandbox's own reward check reads it."""
    tree: Tree = {}
    dirs: dict[str, int] = {}  # each directory's path: how many entries it has that the tree keeps

    def visit(fd: int, name: str, st: os.stat_result, where: str) -> None:
        if stat.S_ISDIR(st.st_mode):
            dirs.setdefault(where + name + "/", 0)
        elif stat.S_ISREG(st.st_mode):
            try:
                file = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
            except OSError:  # gone, or a link put in its place
                return
            try:
                tree[where + name] = os.read(file, READ_LIMIT).decode(errors="replace")
            finally:
                os.close(file)
        else:
            return
        if where:
            dirs[where] = dirs.get(where, 0) + 1

    walk(root, visit)
    tree.update({path: "" for path, kept in dirs.items() if not kept})
    return tree


def write_tree(tree: Tree, root: Path) -> None:
    """Make ``tree`` in the empty directory ``root`` (its paths are ``safe_path``s: they stay inside). What cannot be
    made (a world model's tree with both ``a`` and ``a/b`` as files) is left out: the file that came first wins."""
    for path in sorted(tree):
        target = root / safe_path(path)
        try:
            if path.endswith("/"):
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(tree[path])
        except OSError:
            continue
