"""A cgroup per sandboxed command, where this process may make one: a cap on its processes
(``pids.max``, so a fork bomb stops at the cap) and on the memory of all of them together
(``memory.max``), and a list of every process it ever started, ``setsid`` or not, to count
their open files and to kill them all at the end.

cgroup v2 (one unified tree) is used where the process's own cgroup lets it make children with
the pids and memory controllers; else the v1 ``pids`` and ``memory`` hierarchies (both are
needed). Usually that takes root, or a delegated subtree (systemd's ``Delegate=``). Where neither
works, :func:`create` returns None and the sandbox falls back to per-process ulimits; it says
which in its ``limits`` description.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PREFIX = "localrl-"
_serial = itertools.count()


class CommandGroup:
    """One command's cgroup(s): a v2 directory, or a v1 pids and a v1 memory directory."""

    def __init__(self, dirs: list[Path]):
        self.dirs = dirs

    @property
    def procs_files(self) -> list[str]:
        """The files a process writes its pid into to join (``localrl/envs/confine.py`` does, before exec)."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        found = set()
        for d in self.dirs:
            try:
                found |= {int(line) for line in (d / "cgroup.procs").read_text().split()}
            except (OSError, ValueError):
                pass
        return found

    def kill(self, deadline: float = 5.0) -> None:
        """SIGKILL every process in the group until none is left (pids.max bounds the race with forks)."""
        kill_file = self.dirs[0] / "cgroup.kill"
        if kill_file.exists():
            try:
                kill_file.write_text("1")
            except OSError:
                pass
        stop = time.monotonic() + deadline
        while (pids := self.pids()) and time.monotonic() < stop:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill()
        for d in self.dirs:
            for _ in range(100):  # killed processes leave the group a moment after the signal
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per hierarchy ("" for v2, else the v1 controller names)."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _make(parent: Path, name: str, limits: dict[str, str]) -> Path | None:
    d = parent / name
    try:
        d.mkdir()
    except OSError:
        return None
    try:
        for key, value in limits.items():
            (d / key).write_text(value)
        return d
    except OSError:
        d.rmdir()
        return None


def _sweep(parent: Path) -> None:
    """Remove empty groups left by localrl processes that are gone (killed before their clean-up)."""
    try:
        stale = [d for d in parent.glob(f"{PREFIX}*") if not Path(f"/proc/{d.name.split('-')[1]}").exists()]
    except (OSError, IndexError):
        return
    for d in stale:
        try:
            d.rmdir()
        except OSError:
            pass


def create(max_processes: int, memory_bytes: int) -> CommandGroup | None:
    """A new group with these caps, or None where this process cannot make one."""
    try:
        own = _own_paths()
    except OSError:
        return None
    name = f"{PREFIX}{os.getpid()}-{next(_serial)}"
    if "" in own and (ROOT / "cgroup.controllers").exists():  # v2 mounted at the top
        parent = ROOT / own[""].lstrip("/")
        if {"pids", "memory"} <= set((parent / "cgroup.subtree_control").read_text().split()) or _enable(parent):
            _sweep(parent)
            if d := _make(parent, name, {"pids.max": str(max_processes), "memory.max": str(memory_bytes),
                                         "memory.swap.max": "0"} if (parent / "memory.swap.max").exists() else
                          {"pids.max": str(max_processes), "memory.max": str(memory_bytes)}):
                return CommandGroup([d])
        return None
    if "pids" in own and "memory" in own and (ROOT / "pids").is_dir() and (ROOT / "memory").is_dir():
        pids_parent, memory_parent = ROOT / "pids" / own["pids"].lstrip("/"), ROOT / "memory" / own["memory"].lstrip("/")
        _sweep(pids_parent)
        _sweep(memory_parent)
        pids = _make(pids_parent, name, {"pids.max": str(max_processes)})
        memory = pids and _make(memory_parent, name, {"memory.limit_in_bytes": str(memory_bytes)})
        if pids and memory:
            swap = memory / "memory.memsw.limit_in_bytes"
            if swap.exists():
                try:
                    swap.write_text(str(memory_bytes))
                except OSError:
                    pass
            return CommandGroup([pids, memory])
        if pids:
            pids.rmdir()
    return None


def _enable(parent: Path) -> bool:
    try:
        (parent / "cgroup.subtree_control").write_text("+pids +memory")
        return True
    except OSError:
        return False


def available() -> bool:
    """Whether this process can make a command group here (tried once, then removed)."""
    group = create(16, 2**26)
    if group is None:
        return False
    group.remove()
    return True
