"""The command runner the agent uses: real bash, real processes, real files."""

import time
import uuid
from pathlib import Path

import pytest

from localrl.agent import parse_tool_calls
from localrl.errors import UserError
from localrl.sandbox import Sandbox, isolation_available


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


def test_timeout_kills_the_command_and_its_children(tmp_path):
    seconds = unique_seconds()
    t0 = time.monotonic()
    result = Sandbox(tmp_path, timeout=1.0).run(f"sleep {seconds} & sleep {seconds}")
    assert result.timed_out and result.exit_code is None
    assert time.monotonic() - t0 < 10
    time.sleep(0.2)
    assert processes_running(seconds) == []


def test_the_process_finder_sees_a_live_child(tmp_path):
    """The check above must be able to fail: a process started outside the sandbox is found."""
    import subprocess

    seconds = unique_seconds()
    proc = subprocess.Popen(["sleep", seconds])
    try:
        assert processes_running(seconds) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()


def test_background_children_do_not_outlive_a_finished_command(tmp_path):
    seconds = unique_seconds()
    result = Sandbox(tmp_path).run(f"(sleep {seconds}; touch late) & echo started")
    assert result.exit_code == 0 and "started" in result.output
    time.sleep(0.3)
    assert processes_running(seconds) == []


def test_output_is_capped_without_stalling(tmp_path):
    result = Sandbox(tmp_path, output_limit=1000).run("head -c 5000000 /dev/zero | tr '\\0' x; echo; echo done >&2")
    assert result.truncated and len(result.output) == 1000 and result.exit_code == 0
    assert "[output truncated]" in result.describe()


@pytest.mark.skipif(not isolation_available(), reason="unshare cannot create namespaces here")
def test_no_network_inside(tmp_path):
    probe = "python3 -c \"import socket; s=socket.socket(); s.settimeout(2); print(s.connect_ex(('1.1.1.1', 80)))\""
    result = Sandbox(tmp_path).run(probe)
    assert result.output.strip() not in ("0", "")  # unreachable, whatever the host's network


def test_bad_working_directory_is_one_line(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        Sandbox(tmp_path / "missing")


def test_tool_calls_are_parsed_and_malformed_ones_skipped():
    text = ('<tool_call>{"name": "shell", "arguments": {"command": "ls -la"}}</tool_call> then '
            '<tool_call>{"name": "shell", "arguments": "{\\"command\\": \\"pwd\\"}"}</tool_call>'
            '<tool_call>{not json}</tool_call><tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>')
    assert parse_tool_calls(text) == ["ls -la", "pwd"]
