"""What the person approves is what runs: model text and commands reach a terminal with every character that
acts on it written out, and a command holding one is never approved without asking."""

import io
import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from localrl.agent.approvals import Approvals
from localrl.agent.session import run_agent, terminal_ask
from localrl.visible import hidden_in_command, visible
from tests.helpers import ScriptedModel, tool_call

ESC = "\x1b"
REAL = "ls -la; touch HIDDEN #" + ESC + "[30D" + ESC + "[K"  # erases itself from the line it is printed on
FAKE = '<tool_call>{"name": "shell", "arguments": {"command": "ls -la"}}</tool_call>'
# The probe's reply: the real call, then the cursor back to where it started, the screen cleared, a harmless call.
SPOOF = ESC + "7" + tool_call(REAL) + ESC + "8" + ESC + "[J" + FAKE


@pytest.mark.parametrize("text, shown", [
    ("a\x1b[2Jb", "a\\x1b[2Jb"), ("ok\rno", "ok\\rno"), ("\x07\x08\x7f\x9b", "\\x07\\x08\\x7f\\x9b"),
    ("abc\u202edcba", "abc<U+202E>dcba"), ("rm\u200b -rf", "rm<U+200B> -rf"), ("a\u2066b\u2069", "a<U+2066>b<U+2069>"),
    ("\ufeffls", "<U+FEFF>ls"), ("ls\u00a0-la", "ls<U+00A0>-la"), ("a\u2028b", "a<U+2028>b"),
    ("plain text\n\twith a tab, ünïcödé and 中文", "plain text\n\twith a tab, ünïcödé and 中文"),
])
def test_every_character_that_acts_on_a_terminal_is_written_out(text, shown):
    assert visible(text) == shown
    assert not any(c in visible(text) for c in "\x1b\r\x07\x08\x7f\x9b\u202e\u200b\u2066\ufeff\u00a0\u2028")


def test_in_a_command_tabs_are_written_out_and_new_lines_kept_and_neither_is_hidden():
    assert visible("a\tb\nc", command=True) == "a\\tb\nc"
    assert hidden_in_command("a\tb\nc") == []
    assert hidden_in_command(REAL) == ["\\x1b"]


def test_a_command_with_hidden_characters_is_asked_however_it_starts(tmp_path):
    approvals = Approvals(tmp_path, store=tmp_path / "a.json")
    approvals.remember("ls", allow=True)
    assert approvals.decide("ls -la")[0] == "allow"
    for line in (REAL, "ls\rtouch P", "ls \u202e", "ls\u00a0-la"):
        decision, why = approvals.decide(line)
        assert decision == "ask" and why.startswith("WARNING"), line


def test_the_spoofed_approval_shows_the_real_command_and_runs_only_what_was_approved(tmp_path):
    out, answers = io.StringIO(), io.StringIO("n\n")
    approvals = Approvals(tmp_path, store=tmp_path / "a.json")
    approvals.remember("ls", allow=True)  # the spoof's visible command is allowed: the real one must still ask
    run_agent(ScriptedModel([SPOOF, "done"]), "list", tmp_path, terminal_ask(answers, out), out, approvals=approvals)
    screen = out.getvalue()
    assert ESC not in screen and "\r" not in screen
    assert "run `ls -la; touch HIDDEN #\\x1b[30D\\x1b[K`? (WARNING" in screen
    assert "\\x1b7<think>" in screen and "\\x1b8\\x1b[J" in screen  # the streamed reply's escapes, written out
    assert not (tmp_path / "HIDDEN").exists()  # refused: it never ran


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/usr/bin/tmux"), reason="tmux is not installed")
def test_a_real_terminal_shows_the_real_command_and_runs_what_the_person_approved(tmp_path):
    """The probe's attack on a terminal: tmux runs the agent's prompt, capture-pane reads the screen."""
    script = tmp_path / "agent.py"
    script.write_text(
        "import sys\nsys.path.insert(0, %r)\n" % os.getcwd()
        + "from localrl.agent.approvals import Approvals\nfrom localrl.agent.session import run_agent, terminal_ask\n"
        + "from tests.helpers import ScriptedModel\n"
        + f"reply = {json.dumps(SPOOF)}\nwork = {str(tmp_path)!r}\n"
        + "run_agent(ScriptedModel([reply, 'done']), 'list', work, terminal_ask(), "
          "approvals=Approvals(work, store=work + '/a.json'))\nprint('AGENT-END')\n")
    session = f"localrl-visible-{os.getpid()}"
    tmux = ["tmux", "-L", session]
    subprocess.run([*tmux, "new-session", "-d", "-x", "160", "-y", "40",
                    f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}; sleep 60"], check=True)
    try:
        def screen() -> str:
            return subprocess.run([*tmux, "capture-pane", "-p", "-J"], capture_output=True, text=True).stdout

        deadline = time.monotonic() + 60
        while "[y]es" not in screen() and time.monotonic() < deadline:
            time.sleep(0.2)
        shown = screen()
        assert "touch HIDDEN #\\x1b[30D\\x1b[K" in shown and "WARNING" in shown, shown
        assert not (tmp_path / "HIDDEN").exists()
        subprocess.run([*tmux, "send-keys", "y", "Enter"], check=True)
        while "AGENT-END" not in screen() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (tmp_path / "HIDDEN").exists()  # the command the person saw and approved is the one that ran
        assert "$ ls -la; touch HIDDEN #\\x1b[30D\\x1b[K" in screen()  # and the transcript says so
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
