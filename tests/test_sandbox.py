"""The command runner the agent uses: real bash, real processes, real files."""

import os
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from localrl.agent import parse_tool_calls
from localrl.errors import UserError
from localrl.sandbox import LEVELS, Sandbox, disk_usage, level_works


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
# What each level claims (localrl/sandbox.py's table): the tests hold every level to its claims
# and also check that an unclaimed protection is really absent, so the probes can fail.
CONFINES_WRITES = {"bwrap", "landlock"}
NO_NETWORK = {"bwrap", "landlock", "unshare"}
HIDES_PROCESSES = {"bwrap", "landlock", "unshare"}


def test_the_strongest_working_level_is_chosen(tmp_path):
    assert Sandbox(tmp_path).isolation == next(level for level in LEVELS if level_works(level))
    with pytest.raises(UserError, match="not one of"):
        Sandbox(tmp_path, isolation="chroot")


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_writes_outside_the_workdir(tmp_path, level):
    workdir, outside = tmp_path / "work", tmp_path / "outside"
    workdir.mkdir()
    outside.mkdir()
    result = Sandbox(workdir, isolation=level).run(f"echo in > inside; echo out > {outside}/file; echo out >> ~/../x")
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
    result = Sandbox(tmp_path, timeout=5, isolation=level).run(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED")
    reached = "CONNECTED" in result.output
    assert reached is (level not in NO_NETWORK), result.output
    if reached:
        thread.join(5)
        assert accepted == [True]


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_other_processes_environment(tmp_path, level):
    secret = f"SECRET_{uuid.uuid4().hex}"
    other = subprocess.Popen(["sleep", "30"], env={"TOKEN": secret})
    try:
        result = Sandbox(tmp_path, isolation=level).run(f"cat /proc/{other.pid}/environ; cat /proc/{os.getpid()}/environ")
    finally:
        other.kill()
        other.wait()
    own = Path("/proc/self/environ").read_bytes().split(b"\0")[0].decode()  # the test process's first variable
    seen = secret in result.output
    assert seen is (level not in HIDES_PROCESSES), result.output
    assert (own in result.output) is seen


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_timeout_kills_the_command_and_every_child(tmp_path, level):
    seconds = unique_seconds()
    t0 = time.monotonic()
    command = f"sleep {seconds} & setsid sleep {seconds} & (setsid bash -c 'sleep {seconds} &' &); sleep {seconds}"
    result = Sandbox(tmp_path, timeout=1.0, isolation=level).run(command)
    assert result.timed_out and result.exit_code is None
    assert time.monotonic() - t0 < 8
    time.sleep(0.3)
    assert processes_running(seconds) == []


def test_the_process_finder_sees_a_live_child(tmp_path):
    """The check above must be able to fail: a process started outside the sandbox is found."""
    seconds = unique_seconds()
    proc = subprocess.Popen(["sleep", seconds])
    try:
        assert processes_running(seconds) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_background_children_do_not_outlive_a_finished_command(tmp_path, level):
    seconds = unique_seconds()
    result = Sandbox(tmp_path, isolation=level).run(f"(sleep {seconds}; touch late) & setsid sleep {seconds} & echo started")
    assert result.exit_code == 0 and "started" in result.output
    time.sleep(0.3)
    assert processes_running(seconds) == []


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_disk_use_is_capped(tmp_path, level):
    sandbox = Sandbox(tmp_path, timeout=20, isolation=level, max_file_bytes=8 * 2**20, max_disk_bytes=32 * 2**20)
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
    sandbox = Sandbox(tmp_path, isolation=level, memory_bytes=256 * 2**20, max_open_files=32)
    result = sandbox.run("python3 -c 'bytearray(512 * 2**20)' 2>&1 | tail -1; ulimit -n")
    assert "MemoryError" in result.output and result.output.split()[-1] == "32"


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_output_is_capped_in_the_middle_without_stalling(tmp_path, level):
    result = Sandbox(tmp_path, output_limit=1000, isolation=level).run(
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
