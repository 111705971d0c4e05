"""Snapshot tests of each screen at 80x24 (pytest-textual-snapshot). After an intended change to
the look, review the diff report, then update with ``pytest tests/test_tui_snapshots.py --snapshot-update``."""

from __future__ import annotations

from textual.widgets import Input

from tests.helpers import ScriptedModel, tool_call, wait_for
from localrl.tui.app import LocalRLApp

SIZE = (80, 24)


def _app(tmp_path, **kwargs) -> LocalRLApp:
    return LocalRLApp(runs_dir=tmp_path / "runs", data_dir=tmp_path / "data", **kwargs)


def _snapshot(snap_compare, app: LocalRLApp, before=None) -> bool:
    """The screen after ``before`` ran, with every text cursor hidden: a focused input's cursor
    blinks every 0.5 s, so whether it shows would depend on how fast the machine ran the steps."""
    async def run_before(pilot):
        if before is not None:
            await before(pilot)
        for field in pilot.app.screen.query(Input):
            field.cursor_blink = False  # stops the blink timer and hides the cursor
        await pilot.pause()

    return snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_train_screen(snap_compare, tmp_path):
    assert _snapshot(snap_compare, _app(tmp_path))


def test_train_screen_with_a_form_error(snap_compare, tmp_path):
    async def bad_group(pilot):
        pilot.app.screen.query_one("#field-group_size").value = "1"
        await pilot.click("#start")
        await pilot.pause(0.1)

    assert _snapshot(snap_compare, _app(tmp_path), bad_group)


def test_chat_screen(snap_compare, tmp_path):
    async def open_chat(pilot):
        await pilot.press("f2")
        await pilot.pause()

    assert _snapshot(snap_compare, _app(tmp_path), open_chat)


def test_chat_screen_with_a_reply(snap_compare, tmp_path):
    model = ScriptedModel(["<think>4 + 2 = 6, 3 + 1 = 4</think><answer>46</answer>"])

    async def ask(pilot):
        screen = pilot.app.screen
        screen.query_one("#prompt").value = "What is 12 + 34?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.messages and screen.streaming is None, timeout=10)
        await pilot.pause(0.2)

    assert _snapshot(snap_compare, _app(tmp_path, model=model), ask)


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

    assert _snapshot(snap_compare, _app(tmp_path, model=model, workdir="."), ask)
