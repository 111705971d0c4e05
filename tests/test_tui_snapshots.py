"""Snapshot tests of each screen at 80x24 (pytest-textual-snapshot). After an intended change to
the look, review the diff report, then update with ``pytest tests/test_tui_snapshots.py --snapshot-update``."""

from __future__ import annotations

from tests.helpers import ScriptedModel, tool_call, wait_for
from localrl.tui.app import LocalRLApp

SIZE = (80, 24)


def _app(tmp_path, **kwargs) -> LocalRLApp:
    return LocalRLApp(runs_dir=tmp_path / "runs", data_dir=tmp_path / "data", **kwargs)


def test_train_screen(snap_compare, tmp_path):
    assert snap_compare(_app(tmp_path), terminal_size=SIZE)


def test_train_screen_with_a_form_error(snap_compare, tmp_path):
    async def bad_group(pilot):
        pilot.app.screen.query_one("#field-group_size").value = "1"
        await pilot.click("#start")
        await pilot.pause(0.1)

    assert snap_compare(_app(tmp_path), terminal_size=SIZE, run_before=bad_group)


def test_chat_screen(snap_compare, tmp_path):
    assert snap_compare(_app(tmp_path), terminal_size=SIZE, press=["f2"])


def test_chat_screen_with_a_reply(snap_compare, tmp_path):
    model = ScriptedModel(["<think>4 + 2 = 6, 3 + 1 = 4</think><answer>46</answer>"])

    async def ask(pilot):
        screen = pilot.app.screen
        screen.query_one("#prompt").value = "What is 12 + 34?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.messages and screen.streaming is None, timeout=10)
        await pilot.pause(0.2)

    assert snap_compare(_app(tmp_path, model=model), terminal_size=SIZE, run_before=ask)


def test_agent_screen_asking_for_approval(snap_compare, tmp_path):
    model = ScriptedModel([tool_call("ls -la")])

    async def ask(pilot):
        await pilot.press("f3")
        screen = pilot.app.screen
        screen.query_one("#task").value = "list the files"
        screen.query_one("#task").focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.query_one("#approval").display, timeout=10)
        await pilot.pause(0.2)

    assert snap_compare(_app(tmp_path, model=model, workdir="."), terminal_size=SIZE, run_before=ask)
