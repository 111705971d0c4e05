"""The command runner the agent uses: real bash, real processes, real files."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from localrl.agent.tool_calls import parse_tool_calls
from localrl.envs import cgroups
from localrl.envs.confine import EPISODE_UIDS
from localrl.envs.sandbox import LEVELS, Sandbox, reachable_by_anyone, disk_usage, level_works
from localrl.envs.shell import ShellEnv, expert_call, task_list
from localrl.envs.shell_tasks import generate
from localrl.errors import UserError


def test_runs_in_the_working_directory_with_a_minimal_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    result = Sandbox(tmp_path).run("pwd; echo $HOME; env | sort; echo out; echo err >&2; exit 3")
    lines = result.output.splitlines()
    assert lines[0] == str(tmp_path) and lines[1] == str(tmp_path)
    assert "hunter2" not in result.output
    assert {line.split("=", 1)[0] for line in lines if "=" in line} <= {"PATH", "HOME", "LANG", "TERM", "PWD", "SHLVL",
                                                                        "_", "OLDPWD"}
    assert "out" in lines and "err" in lines  # stderr merged
    assert result.exit_code == 3 and not result.timed_out


def processes_running(marker: str) -> list[int]:
    """Host pids of live processes whose command line contains ``marker`` (a number unique to one test),
    so that only the command's own children are looked for, not every process on the machine."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if marker in cmdline and "zombie" not in state:
            found.append(int(proc.name))
    return found


def unique_seconds() -> str:
    return f"{60 + uuid.uuid4().int % 10**6 / 10**7:.7f}"  # sleep 60.0xxxxxx: no other process has it


LEVELS_HERE = [pytest.param(level, marks=pytest.mark.skipif(not level_works(level),
                                                           reason=f"isolation level {level} does not work here"))
               for level in LEVELS]
# What each level claims (localrl/envs/sandbox.py's table): the tests hold every level to its claims
# and also check that an unclaimed protection is really absent, so the probes can fail.
CONFINES_WRITES = {"bwrap", "landlock", "unshare"}
NO_NETWORK = {"bwrap", "landlock", "unshare"}
HIDES_PROCESSES = {"bwrap", "landlock", "unshare"}
HIDES_HOST_FILES = {"bwrap", "landlock"}  # reads outside the system dirs; the others read what the user may
CAPS_TMPFS = {"bwrap", "unshare"}  # their own size-capped /tmp and /dev/shm (landlock: not writable at all)
ROOT = os.geteuid() == 0
# Who runs the command: a private workdir (the shell environment's) goes to nobody when we are root;
# a root-owned one we were handed (``localrl agent --workdir`` as root) keeps uid 0, without capabilities.
USERS = ["private", "given"]


def reachable(path: Path) -> Path:
    """``path``, made reachable by other users (pytest's tmp_path is root's alone, mode 700)."""
    for d in [path, *path.parents]:
        if d.is_relative_to(tempfile.gettempdir()) and d != Path(tempfile.gettempdir()):
            d.chmod(d.stat().st_mode | 0o011)
    return path


def sandbox(tmp_path, level, user, **kwargs) -> Sandbox:
    workdir = tmp_path / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    reachable(tmp_path)
    if ROOT and level == "process" and user == "given":  # a root-owned directory would keep uid 0: refused
        with pytest.raises(UserError, match="process level would run commands in .* as root"):
            Sandbox(workdir, isolation=level, **kwargs)
        pytest.skip("the process level refuses to run commands as root (test_the_process_level_refuses_root)")
    return Sandbox(workdir, isolation=level, private_workdir=user == "private", **kwargs)


def at_level(workdir: Path, level: str, **kwargs) -> Sandbox:
    """A sandbox at ``level`` in ``workdir``. The process level never runs a command as root: as root, ``workdir`` is
    handed to an episode's own user there, as the shell environment's are."""
    if not (ROOT and level == "process"):
        return Sandbox(workdir, isolation=level, **kwargs)
    return Sandbox(reachable(workdir), isolation=level, private_workdir=True, **kwargs)


def as_nobody(user: str) -> bool:
    return ROOT and user == "private"


def test_the_strongest_working_level_is_chosen(tmp_path):
    assert Sandbox(tmp_path).isolation == next(level for level in LEVELS if level_works(level))
    with pytest.raises(UserError, match="not one of"):
        Sandbox(tmp_path, isolation="chroot")


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_writes_outside_the_workdir(tmp_path, level):
    workdir, outside = tmp_path / "work", tmp_path / "outside"
    workdir.mkdir()
    outside.mkdir()
    outside.chmod(0o777)  # where the command's user, whoever it is, may write unless the level stops it
    result = at_level(workdir, level).run(f"echo in > inside; echo out > {outside}/file; echo out >> ~/../x")
    assert (workdir / "inside").read_text() == "in\n"
    wrote = (outside / "file").exists() or (tmp_path / "x").exists()
    assert wrote is (level not in CONFINES_WRITES), result.output


@pytest.fixture
def loopback_server():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(5)
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted, thread
    server.close()


def _accept(server):
    try:
        conn, _ = server.accept()
        conn.close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_network(tmp_path, level, loopback_server):
    port, accepted, thread = loopback_server
    result = at_level(tmp_path, level, timeout=5).run(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED")
    reached = "CONNECTED" in result.output
    assert reached is (level not in NO_NETWORK), result.output
    if reached:
        thread.join(5)
        assert accepted == [True]


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_other_processes_environment(tmp_path, level):
    secret = f"SECRET_{uuid.uuid4().hex}"
    other = subprocess.Popen(["bash", "-c", "sleep 30; :", f"{secret}-ARGV"], env={"TOKEN": secret})
    try:
        result = at_level(tmp_path, level).run(f"umount /proc; cat /proc/{other.pid}/cmdline; "
                                                        f"cat /proc/{other.pid}/environ")
    finally:
        other.kill()
        other.wait()
    assert (f"{secret}-ARGV" in result.output) is (level not in HIDES_PROCESSES), result.output
    if ROOT:  # a command without capabilities cannot read a capable process's environment, even at uid 0
        assert f"TOKEN={secret}" not in result.output


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_timeout_kills_the_command_and_every_child(tmp_path, level):
    seconds = unique_seconds()
    t0 = time.monotonic()
    command = f"sleep {seconds} & setsid sleep {seconds} & (setsid bash -c 'sleep {seconds} &' &); sleep {seconds}"
    result = at_level(tmp_path, level, timeout=1.0).run(command)
    assert result.timed_out and result.exit_code is None
    assert time.monotonic() - t0 < 8
    time.sleep(0.3)
    assert processes_running(seconds) == []


def test_the_process_finder_sees_a_live_child(tmp_path):
    """The check above must be able to fail: a process started outside the sandbox is found."""
    seconds = unique_seconds()
    proc = subprocess.Popen(["sleep", seconds])
    try:
        deadline = time.monotonic() + 5
        while not processes_running(seconds) and time.monotonic() < deadline:  # until the child has exec'd sleep
            time.sleep(0.01)
        assert processes_running(seconds) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_background_children_do_not_outlive_a_finished_command(tmp_path, level):
    seconds = unique_seconds()
    result = at_level(tmp_path, level).run(f"(sleep {seconds}; touch late) & setsid sleep {seconds} & echo started")
    assert result.exit_code == 0 and "started" in result.output
    time.sleep(0.3)
    assert processes_running(seconds) == []


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_disk_use_is_capped(tmp_path, level):
    sandbox = at_level(tmp_path, level, timeout=20, max_file_bytes=8 * 2**20, max_disk_bytes=32 * 2**20)
    result = sandbox.run("for i in $(seq 1 100); do head -c 4000000 /dev/zero > f$i || exit 9; done")
    assert result.over_disk and result.exit_code is None and "disk quota" in result.describe()
    assert disk_usage(tmp_path) < 128 * 2**20  # 100 files of 4 MB were asked for
    assert sandbox.run("echo still here").over_disk  # nothing runs while the directory is over its quota
    for f in tmp_path.glob("f*"):
        f.unlink()
    big = sandbox.run("head -c 9000000 /dev/zero > big; echo status $?")
    assert "status 0" not in big.output and (tmp_path / "big").stat().st_size <= 8 * 2**20


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_memory_and_open_files_are_limited(tmp_path, level):
    sandbox = at_level(tmp_path, level, memory_bytes=256 * 2**20, max_open_files=32)
    result = sandbox.run("python3 -c 'bytearray(512 * 2**20)' 2>&1 | tail -1; ulimit -n")
    assert "MemoryError" in result.output and result.output.split()[-1] == "32"


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_output_is_capped_in_the_middle_without_stalling(tmp_path, level):
    result = at_level(tmp_path, level, output_limit=1000).run(
        "echo first; head -c 5000000 /dev/zero | tr '\\0' x; echo; echo last >&2")
    assert result.truncated and result.exit_code == 0
    assert result.output.startswith("first") and result.output.rstrip().endswith("last")
    assert len(result.output) < 1100 and "[output truncated]" in result.describe()


def test_bad_working_directory_is_one_line(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        Sandbox(tmp_path / "missing")


def test_tool_calls_are_parsed_and_malformed_ones_skipped():
    text = ('<tool_call>{"name": "shell", "arguments": {"command": "ls -la"}}</tool_call> then '
            '<tool_call>{"name": "shell", "arguments": "{\\"command\\": \\"pwd\\"}"}</tool_call>'
            '<tool_call>{not json}</tool_call><tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>')
    assert parse_tool_calls(text) == ["ls -la", "pwd"]


# -- attacks: each test is what a hostile model's command would try; it fails if the attack works ------------

def test_a_private_workdir_runs_as_its_own_user_and_a_given_root_one_as_root_without_capabilities(tmp_path):
    private, given = sandbox(tmp_path / "a", None, "private"), sandbox(tmp_path / "b", None, "given")
    if ROOT:
        assert private.runs_as.startswith("the episode's own user (uid ") and given.runs_as == "root without capabilities"
        assert (tmp_path / "a" / "work").stat().st_uid == private.user[0] != 65534
    else:
        assert private.runs_as == given.runs_as == "the caller's user"


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("level", LEVELS_HERE)
def test_no_capability_and_no_remount_of_the_host(tmp_path, level, user):
    target = Path("/etc") / f"localrl-probe-{uuid.uuid4().hex}"
    try:
        result = sandbox(tmp_path, level, user).run(
            "grep CapEff /proc/self/status; mount -o remount,bind,rw /etc; mount -o remount,rw /; "
            f"echo pwned > {target}; touch f; chown 4321 f && echo CHOWNED")
        wrote = target.exists()
    finally:
        target.unlink(missing_ok=True)
    assert wrote is not (level in CONFINES_WRITES or as_nobody(user) or not ROOT), result.output
    assert "CHOWNED" not in result.output
    if "CapEff" in result.output:  # landlock hides /proc/self: chown (CAP_CHOWN) is the probe there
        assert "CapEff:\t0000000000000000" in result.output


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("level", LEVELS_HERE)
def test_host_files_metadata_and_dev_shm(tmp_path, level, user):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_text("host\n")
    victim.chmod(0o644)
    shm = Path("/dev/shm") / f"localrl-probe-{uuid.uuid4().hex}"
    shm.write_text("host\n")
    shm.chmod(0o666 if not ROOT else 0o644)
    before = victim.stat()
    try:
        result = sandbox(tmp_path, level, user).run(
            f"chmod 777 {victim}; chown 4321 {victim}; touch -d 2001-01-01 {victim}; echo x >> {victim}; "
            f"python3 -c 'import os; os.setxattr(\"{victim}\", \"user.x\", b\"1\")'; echo pwned > {shm}")
        after = victim.stat()
        changed = (after.st_mode, after.st_uid, after.st_mtime, victim.read_text()) != \
            (before.st_mode, before.st_uid, before.st_mtime, "host\n")
        shm_written = shm.read_text() != "host\n"
    finally:
        shm.unlink()
    claimed = level in CONFINES_WRITES or as_nobody(user)
    assert changed is not claimed or not changed and claimed, result.output
    if claimed:
        assert not changed and not shm_written, result.output


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("level", LEVELS_HERE)
def test_no_device_nodes_device_writes_or_terminal_injection(tmp_path, level, user):
    marker = f"localrl-probe-{uuid.uuid4().hex}"
    kmsg = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK) if ROOT and os.path.exists("/dev/kmsg") else None
    if kmsg is not None:
        os.lseek(kmsg, 0, os.SEEK_END)
    master, slave = os.openpty()
    os.set_blocking(master, False)
    try:
        result = sandbox(tmp_path, level, user).run(
            f"mknod blk b 7 0 && echo MADE-BLOCK; mknod chr c 1 3 && echo MADE-CHAR; mkfifo fifo && echo FIFO; "
            f"echo {marker} > /dev/kmsg && echo KMSG; "
            f"python3 -c 'import fcntl, termios; f = open(\"{os.ttyname(slave)}\", \"wb\"); "
            f"[fcntl.ioctl(f, termios.TIOCSTI, bytes([c])) for c in b\"{marker}\"]' && echo INJECTED")
        try:
            typed = os.read(master, 4096).decode(errors="replace")
        except BlockingIOError:
            typed = ""
    finally:
        os.close(master)
        os.close(slave)
    assert "MADE-BLOCK" not in result.output and "MADE-CHAR" not in result.output, result.output
    assert "FIFO" in result.output  # FIFOs are ordinary files: allowed
    assert marker not in typed and "INJECTED" not in result.output, result.output
    if kmsg is not None:  # the kernel log itself: a "/dev/kmsg" the sandbox made up is no attack
        logged = kernel_log_since(kmsg)
        assert (marker in logged) is (level == "process" and not as_nobody(user)), result.output


def kernel_log_since(fd: int) -> str:
    records = []
    try:
        while True:
            records.append(os.read(fd, 8192).decode(errors="replace"))
    except (BlockingIOError, BrokenPipeError):
        pass
    finally:
        os.close(fd)
    return "".join(records)


@pytest.mark.parametrize("level", [p for p in LEVELS_HERE if p.values[0] == "landlock"])
def test_landlock_refuses_device_ioctls_and_tmp(tmp_path, level):
    result = sandbox(tmp_path, level, "private").run(
        "python3 -c 'import fcntl, termios; fcntl.ioctl(open(\"/dev/null\"), termios.TCGETS)' 2>&1 | tail -1; "
        "echo x > /tmp/localrl-probe && echo TMP; for d in / /tmp /proc /root /home; do ls $d >/dev/null 2>&1 && "
        "echo LISTED $d; done; ls /usr >/dev/null && echo SYSTEM")
    assert "PermissionError" in result.output and "TMP" not in result.output, result.output
    assert "LISTED" not in result.output and "SYSTEM" in result.output, result.output  # listing: system dirs only


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("level", LEVELS_HERE)
def test_reading_host_secrets(tmp_path, level, user):
    # as root, a root-only file outside /tmp (which unshare and bwrap replace), like /root/.ssh/id_rsa
    outside = Path(f"/localrl-probe-{uuid.uuid4().hex}") if ROOT else tmp_path / "outside"
    outside.mkdir(mode=0o755)
    try:
        secret = outside / "id_rsa"
        secret.write_text(f"SECRET-{uuid.uuid4().hex}\n")
        secret.chmod(0o600)
        result = sandbox(tmp_path, level, user).run(f"cat {secret}; cat /etc/shadow | head -1")
        read = secret.read_text().strip() in result.output
    finally:
        shutil.rmtree(outside)
    assert read is not (level in HIDES_HOST_FILES or as_nobody(user)) or not ROOT, result.output
    if ROOT and (level in ("bwrap", "unshare") or as_nobody(user)):
        assert "root:" not in result.output, result.output  # /etc/shadow: hidden, or unreadable for nobody


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_proc_cannot_be_unmounted_to_see_the_host(tmp_path, level):
    secret = f"SECRET_{uuid.uuid4().hex}"
    other = subprocess.Popen(["bash", "-c", "sleep 30; :", secret])
    try:
        result = sandbox(tmp_path, level, "given").run(
            f"umount /proc; umount -l /proc; cat /proc/{other.pid}/cmdline")
    finally:
        other.kill()
        other.wait()
    assert (secret in result.output) is (level not in HIDES_PROCESSES), result.output


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("level", LEVELS_HERE)
def test_killing_its_watcher_leaves_nothing_running(tmp_path, level, user):
    seconds = unique_seconds()
    result = sandbox(tmp_path, level, user).run(f"setsid sleep {seconds} & sleep 0.2; kill -9 $PPID; sleep 0.5")
    time.sleep(0.3)
    survivors = processes_running(seconds)
    for pid in survivors:
        os.kill(pid, 9)
    if cgroups.available() or as_nobody(user) or level in ("bwrap", "unshare"):
        assert survivors == [], result.output


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("level", LEVELS_HERE)
def test_the_disk_quota_counts_deleted_open_files_and_hidden_directories(tmp_path, level, user):
    box = sandbox(tmp_path, level, user, timeout=20, max_file_bytes=8 * 2**20, max_disk_bytes=8 * 2**20)
    deleted = box.run("exec 3>a 4>b 5>c 6>d; for fd in 3 4 5 6; do head -c 7000000 /dev/zero >&$fd; done; "
                      "rm a b c d; sleep 5; echo KEPT")
    assert deleted.over_disk and "KEPT" not in deleted.output, deleted.output
    hidden = box.run("mkdir d; for i in 1 2 3; do head -c 6000000 /dev/zero > d/f$i; done; chmod 000 d; sleep 5; "
                     "echo KEPT")
    assert hidden.over_disk and "KEPT" not in hidden.output, hidden.output


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_tmp_and_dev_shm_are_capped_where_the_level_has_its_own(tmp_path, level):
    box = sandbox(tmp_path, level, "private", timeout=20, max_disk_bytes=8 * 2**20)
    result = box.run("for d in /tmp /dev/shm; do head -c 20000000 /dev/zero > $d/localrl-probe-big; "
                     "echo $d $(stat -c %s $d/localrl-probe-big); rm -f $d/localrl-probe-big; done")
    sizes = [int(line.split()[1]) for line in result.output.splitlines() if line.startswith("/") and
             len(line.split()) == 2 and line.split()[1].isdigit()]
    if level in CAPS_TMPFS:
        assert sizes and max(sizes) <= 8 * 2**20, result.output
    if level == "landlock":
        assert sizes == [], result.output


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("level", LEVELS_HERE)
def test_a_fork_bomb_stops_at_the_process_cap(tmp_path, level, user):
    box = sandbox(tmp_path, level, user, timeout=15, max_processes=32)
    result = box.run("python3 -c '\nimport os, time\nn = 0\ntry:\n    while n < 500:\n        if os.fork() == 0:\n"
                     "            time.sleep(20)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\n"
                     "print(\"forked\", n)'")
    forked = [int(line.split()[1]) for line in result.output.splitlines() if line.startswith("forked")]
    if cgroups.available() or as_nobody(user):
        assert forked and forked[0] < 32, result.output


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_memory_is_capped_for_all_processes_together(tmp_path, level):
    if not cgroups.available():
        pytest.skip("no cgroup can be made here: memory is capped per process only (the README says so)")
    box = sandbox(tmp_path, level, "private", timeout=20, memory_bytes=256 * 2**20)
    # the cap may kill a process after it printed HELD (the kernel picks the largest), so count the ones that
    # held their 150 MB to the end: all three together would need 450 MB
    result = box.run("for i in 1 2 3; do python3 -c 'import time; b = b\"x\" * (150 * 2**20); print(\"HELD\", "
                     "flush=True); time.sleep(3); print(\"KEPT\", flush=True)' & done; wait")
    assert result.output.count("HELD") >= 1, result.output
    assert result.output.splitlines().count("KEPT") < 3, result.output


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_the_shell_environment_path_is_confined_too(level):
    """Training rollouts reach the sandbox through ShellEnv.step: the same attacks fail there."""
    target = Path("/etc") / f"localrl-probe-{uuid.uuid4().hex}"
    env = ShellEnv(task_list([generate(0, "count", 1)]), isolation=level, timeout=5)
    try:
        env.reset(0)
        observation, _ = env.step(expert_call(f"grep CapEff /proc/self/status; mount -o remount,rw /etc; "
                                              f"echo pwned > {target}; id -u"))
        assert not target.exists(), observation
        if ROOT:  # the episode's own user
            assert any(line.isdigit() and int(line) in EPISODE_UIDS for line in observation.splitlines()), observation
        if "CapEff" in observation:
            assert "CapEff:\t0000000000000000" in observation
    finally:
        target.unlink(missing_ok=True)
        env.close()


def python_for_nobody() -> list[str] | None:
    """A command line that starts this Python's environment as another user, or None: a venv whose
    interpreter lies in root's home (mode 700) is reached through the system's Python of the same version."""
    # those that exist: cmeel.pth (from the allocator's wheel) adds one that need not
    site_dirs = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    for exe in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        if os.path.exists(exe) and reachable_by_anyone(exe) and all(reachable_by_anyone(d) for d in site_dirs):
            return [exe, "-c", "import site, sys; [site.addsitedir(d) for d in sys.argv[1].split(':')]; "
                    "sys.argv = sys.argv[1:]; import pytest; sys.exit(pytest.main(sys.argv[1:]))", ":".join(site_dirs)]
    return None


@pytest.mark.slow
@pytest.mark.skipif(not ROOT, reason="switching to an unprivileged user needs root")
def test_every_attack_fails_for_an_unprivileged_caller_too():
    """CI runs as root; people run localrl as themselves. This file again, as nobody (in one process: xdist's
    workers would start without the site directories this command line adds)."""
    python, repo = python_for_nobody(), Path(__file__).resolve().parents[1]
    if python is None or not reachable_by_anyone(str(repo)):
        pytest.skip("no Python that nobody may run reaches this environment and checkout")
    base = Path(tempfile.mkdtemp(prefix="localrl-nobody-"))
    os.chown(base, 65534, 65534)
    try:
        done = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *python,
                               str(repo / "tests" / "test_sandbox.py"), "-q", "-p", "no:cacheprovider",
                               "-n", "0", "-m", "not slow", "--basetemp", str(base / "t"), "--rootdir", str(repo)],
                              cwd=repo, env={"PATH": os.environ["PATH"], "HOME": str(base),
                                             "PYTHONPATH": str(repo)},
                              capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


# -- seccomp, decoded ---------------------------------------------------------------------------------------

# Written here, not taken from confine.py: a syscall dropped from the module's list must fail this test.
# (x86_64 numbers)
MUST_BE_REFUSED = {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "mount": 165, "umount2": 166,
                   "pivot_root": 155, "unshare": 272, "setns": 308, "io_uring_setup": 425, "io_uring_enter": 426,
                   "bpf": 321, "keyctl": 250, "add_key": 248, "request_key": 249, "userfaultfd": 323,
                   "perf_event_open": 298, "init_module": 175, "finit_module": 313, "delete_module": 176,
                   "kexec_load": 246, "kexec_file_load": 320, "syslog": 103, "reboot": 169, "open_by_handle_at": 304,
                   "fsopen": 430, "fsmount": 432, "move_mount": 429, "open_tree": 428, "swapon": 167, "acct": 163}
ALLOWED = {"read": 0, "write": 1, "openat": 257, "execve": 59, "getpid": 39, "socketpair": 53}
AF_INET, AF_UNIX, AF_VSOCK, AF_NETLINK = 2, 1, 40, 16
X86_64 = 0xC000003E


def run_filter(program: bytes, number: int, args=(0,) * 6, arch: int = X86_64) -> str:
    """What a classic-BPF seccomp program answers for one call: "allow" or "errno N" (a small interpreter of
    the instructions such a filter uses; any other instruction fails the test)."""
    import struct as st

    data = st.pack("=iIQ6Q", number, arch, 0, *args)  # struct seccomp_data: nr, arch, instruction_pointer, args
    ops = [st.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = ops[pc]
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = st.unpack_from("=I", data, k)[0]
        elif code == 0x54:  # BPF_ALU | BPF_AND | BPF_K
            acc &= k
        elif code in (0x15, 0x35, 0x45):  # JEQ, JGE, JSET
            taken = acc == k if code == 0x15 else (acc >= k if code == 0x35 else bool(acc & k))
            pc += jt if taken else jf
        elif code == 0x06:  # BPF_RET | BPF_K
            return "allow" if k == 0x7FFF0000 else (f"errno {k & 0xFFFF}" if k >> 16 == 5 else f"ret {k:#x}")
        else:
            raise AssertionError(f"instruction {code:#x}")
        pc += 1


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the numbers above are x86_64's")
@pytest.mark.parametrize("no_sockets, no_metadata", [(False, False), (True, True), (True, False)])
def test_the_seccomp_filter_refuses_what_this_test_lists(no_sockets, no_metadata):
    from localrl.envs.confine import seccomp_program

    program = seccomp_program(no_sockets, no_metadata)
    for name, number in MUST_BE_REFUSED.items():
        assert run_filter(program, number).startswith("errno"), name
    for name, number in ALLOWED.items():
        assert run_filter(program, number) == "allow", name
    for domain in (AF_UNIX, AF_VSOCK):  # a host socket's path is reachable whatever the mounts
        assert run_filter(program, 41, (domain, 1, 0, 0, 0, 0)).startswith("errno"), domain
    assert run_filter(program, 41, (AF_INET, 1, 0, 0, 0, 0)) == ("errno 13" if no_sockets else "allow")
    assert run_filter(program, 16, (0, 0x5412, 0, 0, 0, 0)).startswith("errno")  # TIOCSTI
    assert run_filter(program, 56, (0x10000000, 0, 0, 0, 0, 0)).startswith("errno")  # clone(CLONE_NEWUSER)
    assert run_filter(program, 90).startswith("errno") is no_metadata  # chmod
    assert run_filter(program, 0, arch=0x40000003).startswith("errno")  # i386's ABI
    assert run_filter(program, 0x40000000 + 1).startswith("errno")  # x32's


PROBE = ("perl -MSocket -e '"
         "sub says { my $r = shift; $r == -1 ? ($!+0) : \"ok\" } "
         "print \"ptrace=\", says(syscall(101, 0, 0, 0, 0)), \"\\n\"; "  # PTRACE_TRACEME
         "print \"vm_readv=\", says(syscall(310, $$, 0, 0, 0, 0, 0)), \"\\n\"; "
         "print \"nnp=\", syscall(157, 39, 0, 0, 0, 0), \"\\n\"; "  # prctl(PR_GET_NO_NEW_PRIVS)
         "for my $d (1, 40) { print \"socket$d=\", (socket(my $s, $d, 1, 0) ? \"ok\" : $!+0), \"\\n\" } "
         "socket(my $u, PF_UNIX, SOCK_STREAM, 0) && connect($u, pack_sockaddr_un($ARGV[0])) && print \"CONNECTED\\n\"'")


@pytest.mark.skipif(os.uname().machine != "x86_64" or not os.path.exists("/usr/bin/perl"), reason="x86_64 and perl")
@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("level", LEVELS_HERE)
def test_no_ptrace_no_unix_or_vsock_socket_and_no_new_privileges_at_every_level(tmp_path, level, user):
    box = sandbox(tmp_path, level, user, timeout=20)
    host = socket.socket(socket.AF_UNIX)
    path = tmp_path / "host.sock"
    host.bind(str(path))
    host.listen(1)
    path.chmod(0o777)
    try:
        result = box.run(f"{PROBE} {path}")
    finally:
        host.close()
    said = dict(line.split("=", 1) for line in result.output.splitlines() if "=" in line)
    assert said == {"ptrace": "1", "vm_readv": "1", "nnp": "1", "socket1": "13", "socket40": "13"}, result.output
    assert "CONNECTED" not in result.output


# -- the working directory's tree: any depth, any path length, nothing followed ---------------------------------

DEEP = "mkdir -p $(printf 'a/%.0s' $(seq 1100))"  # deeper than Python's recursion limit


def du_below(root: Path) -> int:
    """Bytes allocated below ``root`` as coreutils' du counts them (fts: any depth), less ``root`` itself."""
    whole = int(subprocess.run(["du", "-s", "-B1", str(root)], capture_output=True, text=True).stdout.split()[0])
    return whole - os.lstat(root).st_blocks * 512


def test_a_deep_tree_breaks_neither_the_step_nor_the_next_environment(tmp_path):
    env = ShellEnv(task_list([generate(0, "count", 1)]), root=tmp_path)
    env.reset(0)
    workdir = env.workdir
    observation, _ = env.step(expert_call(DEEP))
    assert "exit code 0" in observation
    assert disk_usage(workdir) == du_below(workdir) > 0  # every level counted, as du counts them
    env.close()
    assert not workdir.exists()
    planted = tmp_path / "localrl-shell-999999999-x"  # a dead process's, or anyone's planted in /tmp
    planted.mkdir()
    subprocess.run(["bash", "-c", DEEP], cwd=planted, check=True)
    ShellEnv(task_list([generate(0, "count", 1)]), root=tmp_path)  # its start-up sweep neither raises nor leaves it
    assert not planted.exists()


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_paths_past_path_max_count_toward_the_quota(tmp_path, level):
    name = "d" * 250
    box = sandbox(tmp_path, level, "private", max_disk_bytes=4 * 2**20, timeout=20)
    result = box.run(f"for i in $(seq 18); do mkdir {name} && cd {name} || exit 1; done; "
                     "head -c 32M /dev/zero > f; sleep 2; echo FINISHED")
    assert result.over_disk and "FINISHED" not in result.output, result.output


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_an_episode_never_holds_more_than_its_quota_on_disk_where_it_has_its_own_file_system(tmp_path, level):
    """As root with loop devices, an episode's directory is a file system of the quota's size: the long-path write
    fails for space and never lands past the quota, however fast. Elsewhere the walk kills it (as above)."""
    from localrl.envs import quota_fs

    env = ShellEnv(task_list([generate(0, "count", 1)]), root=reachable(tmp_path), isolation=level,
                   disk_quota=4 * 2**20, timeout=20)
    env.reset(0)
    workdir = env.workdir
    assert env.own_file_system == quota_fs.possible()  # where it can be made, it is: no silent fallback
    name = "d" * 250
    wait = "" if env.own_file_system else "sleep 2; "  # the walk's polls need the time a loaded machine takes
    observation, _ = env.step(expert_call(f"for i in $(seq 18); do mkdir {name} && cd {name} || exit 1; done; "
                                          f"head -c 32M /dev/zero > f; wc -c < f; {wait}echo FINISHED"))
    if env.own_file_system:
        assert "No space left on device" in observation and "FINISHED" in observation, observation
        written = int(observation.split("No space left on device")[1].split()[0])
        assert 2**20 < written < 4 * 2**20 and disk_usage(workdir) <= 4 * 2**20
        assert "exit code 0" in env.step(expert_call("rm -r d* && echo x > y"))[0]  # room again once freed
    else:
        assert "disk quota" in observation and "FINISHED" not in observation, observation
    env.close()
    assert not workdir.exists() and str(workdir) not in Path("/proc/self/mountinfo").read_text()
    ShellEnv(root=tmp_path).reset(0)  # the next environment starts


@pytest.mark.skipif(not ROOT, reason="only root mounts an episode's own file system")
def test_a_killed_processs_episode_file_system_is_unmounted_and_removed_by_the_next_sweep(tmp_path):
    from localrl.envs import quota_fs

    if not quota_fs.possible():
        pytest.skip("no loop devices or mkfs.ext4 here: episodes are measured by the walk")
    code = ("import os, sys; from localrl.envs.shell import ShellEnv; env = ShellEnv(root=sys.argv[1]); env.reset(0); "
            "assert env.own_file_system; print(env.workdir, flush=True); os._exit(9)")
    left = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    workdir = left.stdout.strip()
    assert left.returncode == 9 and workdir in Path("/proc/self/mountinfo").read_text(), left.stderr
    ShellEnv(root=tmp_path)
    assert not os.path.exists(workdir) and workdir not in Path("/proc/self/mountinfo").read_text()


def test_a_directory_swapped_for_a_link_mid_walk_is_neither_entered_nor_changed(tmp_path):
    from localrl.envs.tree import allocated_bytes, walk

    root, victim = tmp_path / "work", tmp_path / "victim"
    for d in (root, root / "hidden", root / "swapped", victim):
        d.mkdir()
    (root / "hidden" / "kept").write_bytes(b"x" * 65536)
    (victim / "host-secret").write_bytes(b"s" * 2**20)
    (root / "hidden").chmod(0)  # made unreadable by the command (walked as its user, this is made readable again)
    victim.chmod(0o700)
    swapped = []

    def swap(fd, name, st, where):  # between the walk's look at "swapped" and its entering it
        if not swapped:
            os.rmdir(root / "swapped")
            os.symlink(victim, root / "swapped")
            swapped.append(name)

    walk(root, swap)
    assert (victim.stat().st_mode & 0o777) == 0o700  # no chmod through the link
    size = allocated_bytes(root)
    assert 65536 <= size < 2**20  # the hidden file counted, the host's not


# -- episodes side by side -------------------------------------------------------------------------------------

@pytest.mark.skipif(not ROOT, reason="episodes get users of their own only when localrl runs as root")
@pytest.mark.parametrize("level", LEVELS_HERE)
def test_an_episode_cannot_see_or_touch_a_sibling_episodes_directory(tmp_path, level):
    """The probe's reward hack: episodes ran as one user, so one could chmod 000 another's directory (its score
    fell to 0) or list /tmp. Each episode now has its own user, and Landlock handles directory listing."""
    mine = sandbox(tmp_path / "a", level, "private")
    sibling_box = sandbox(tmp_path / "b", level, "private")
    sibling = sibling_box.workdir
    assert mine.user != sibling_box.user and mine.runs_as.startswith("the episode's own user")
    (sibling / "answer.txt").write_text("42\n")
    os.chown(sibling / "answer.txt", *sibling_box.user)
    mode = sibling.stat().st_mode
    result = mine.run(f"ls {sibling} 2>/dev/null | sed s/^/LISTED:/; chmod 000 {sibling}; "
                      f"chmod 000 {sibling}/answer.txt; rm -f {sibling}/answer.txt; echo x > {sibling}/planted; "
                      "ls / >/dev/null 2>&1 && echo LISTED-ROOT; echo DONE")
    assert "DONE" in result.output
    assert sibling.stat().st_mode == mode and (sibling / "answer.txt").read_text() == "42\n"
    assert (sibling / "answer.txt").stat().st_mode & 0o777 != 0 and not (sibling / "planted").exists()
    assert "LISTED:" not in result.output, result.output
    assert ("LISTED-ROOT" in result.output) is (level in ("unshare", "process", "bwrap")), result.output
    assert sibling_box.run("cat answer.txt").output == "42\n"  # the sibling scores as if alone


MAKE_COPY = """
import sys, time
import localrl.envs.sandbox as s
s.reachable_by_anyone = lambda path: False  # as when the wheel's bwrap lies in root's home (mode 700)
print(s.bwrap_for_others(), flush=True)
if sys.argv[1] == "hang":
    time.sleep(60)
"""


@pytest.mark.skipif(not ROOT or not level_works("bwrap"), reason="a copy is made only by root, for another user")
def test_the_bwrap_copy_for_other_users_is_removed_at_exit_and_after_a_kill(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", MAKE_COPY, "exit"], capture_output=True, text=True, env=env)
    copy = Path(done.stdout.strip())
    assert copy.name == "bwrap" and copy.parent.parent == tmp_path, done.stderr
    assert not copy.parent.exists()  # removed at exit
    killed = subprocess.Popen([sys.executable, "-c", MAKE_COPY, "hang"], stdout=subprocess.PIPE, text=True, env=env)
    left = Path(killed.stdout.readline().strip())
    killed.kill()
    killed.wait()
    assert left.exists()  # a kill -9 runs no exit handler
    subprocess.run([sys.executable, "-c", MAKE_COPY, "exit"], capture_output=True, env=env, check=True)
    assert not left.parent.exists() and list(tmp_path.iterdir()) == []  # swept by the next process that made one


@pytest.mark.skipif(not ROOT, reason="only root has a uid 0 to keep")
def test_the_process_level_refuses_root_and_no_command_leaves_its_cgroup(tmp_path):
    """The probe's: at the process level as uid 0 a command moved itself to the root cgroup, raised its own
    pids.max and outlived the run. The process level now never runs as root; no level's command leaves its group."""
    with pytest.raises(UserError, match="as root"):
        Sandbox(tmp_path, isolation="process")
    assert not level_works("process", None)
    marker = unique_seconds()
    for level in [p.values[0] for p in LEVELS_HERE if level_works(p.values[0])]:
        box = sandbox(tmp_path / level, level, "private")
        result = box.run(f"echo $$ > /sys/fs/cgroup/cgroup.procs; echo 100000 > /sys/fs/cgroup/pids.max; "
                         f"(setsid sleep {marker} &); echo DONE")
        assert "DONE" in result.output
        assert processes_running(marker) == [], (level, result.output)


def test_the_levels_this_machine_must_offer_all_work():
    """A level that stops working here would turn its tests into skips; the machines CI runs on name the levels
    they offer (.ci/run sets LOCALRL_EXPECT_LEVELS), so one that stops working fails instead."""
    expected = [level for level in os.environ.get("LOCALRL_EXPECT_LEVELS", "").split(",") if level]
    if not expected:
        pytest.skip("LOCALRL_EXPECT_LEVELS names no level this machine must offer")
    assert [level for level in expected if not level_works(level)] == []
