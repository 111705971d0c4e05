"""Run a shell command proposed by a model: in a chosen directory, with a timeout, an output cap
and a minimal environment. The terminal UI's agent uses it; agent training can reuse it.

What a run gets:
- ``bash -c COMMAND`` in ``workdir``, stdin closed, stdout and stderr merged;
- an environment of PATH, HOME (= workdir), LANG and TERM=dumb only: no tokens, keys or
  proxies leak from the parent;
- a timeout that kills the whole process group (and, with isolation, every process in the
  command's PID namespace), so background children do not outlive it;
- at most ``output_limit`` characters of output kept (the rest is read and dropped, so a
  chatty command cannot stall on a full pipe);
- file-size and CPU-time limits (``resource``);
- where ``unshare`` works (util-linux; unprivileged user namespaces), a private network and
  PID namespace: no network access, and no survivor after the command ends.

Deliberate limits: this is damage control for commands a person has approved, not a
security boundary. Without bubblewrap or a container the file system outside ``workdir`` is
still writable; approval is the guard.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from localrl.errors import UserError

UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"]


@dataclass
class CommandResult:
    command: str
    exit_code: int | None  # None when killed by the timeout
    output: str
    timed_out: bool
    truncated: bool
    seconds: float

    def describe(self) -> str:
        """The result as the model and the transcript see it."""
        status = (f"timed out after {self.seconds:.0f} s" if self.timed_out else f"exit code {self.exit_code}")
        note = "\n[output truncated]" if self.truncated else ""
        return f"$ {self.command}\n{self.output.rstrip()}{note}\n[{status}]"


@lru_cache(maxsize=1)
def isolation_available() -> bool:
    """Whether ``unshare`` can give commands their own user, network and PID namespaces here."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class Sandbox:
    def __init__(self, workdir: str | Path, timeout: float = 30.0, output_limit: int = 16_000,
                 max_file_bytes: int = 256 * 2**20, isolate: bool | None = None):
        self.workdir = Path(workdir).expanduser().resolve()
        if not self.workdir.is_dir():
            raise UserError(f"sandbox: working directory {workdir} does not exist")
        if timeout <= 0 or output_limit <= 0:
            raise UserError("sandbox: timeout and output_limit must be positive")
        self.timeout = timeout
        self.output_limit = output_limit
        self.max_file_bytes = max_file_bytes
        self.isolated = isolation_available() if isolate is None else isolate

    def environment(self) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.workdir), "LANG": "C.UTF-8", "TERM": "dumb"}

    def _limits(self) -> None:  # runs in the child, before exec
        cpu = int(self.timeout) + 5
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.max_file_bytes, self.max_file_bytes))

    def run(self, command: str) -> CommandResult:
        argv = [*UNSHARE, "bash", "-c", command] if self.isolated else ["bash", "-c", command]
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=self.workdir, env=self.environment(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=self._limits)
        kept: list[bytes] = []
        state = {"size": 0, "truncated": False}

        def drain() -> None:  # keep the first output_limit bytes, read and drop the rest
            for chunk in iter(lambda: proc.stdout.read1(65536), b""):
                room = self.output_limit - state["size"]
                if room > 0:
                    kept.append(chunk[:room])
                    state["size"] += min(len(chunk), room)
                state["truncated"] |= len(chunk) > room

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc.pid)  # survivors of a finished command, or the whole timed-out tree
            proc.wait()
        reader.join(timeout=5)
        output = b"".join(kept).decode("utf-8", errors="replace")
        return CommandResult(command, None if timed_out else proc.returncode, output, timed_out,
                             state["truncated"], time.monotonic() - t0)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
