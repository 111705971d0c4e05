"""The terminal UI driven through Textual's Pilot: real training subprocesses, the real tiny model,
real shell commands (asserted on the file system, not only on the screen)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from localrl.tui.app import LocalRLApp
from localrl.tui.widgets import Message, MetricChart
from tests.helpers import ScriptedModel, tool_call, wait_for

SIZE = (80, 24)


def run(coro):
    return asyncio.run(coro)


# -- Train ---------------------------------------------------------------------------------


def _fill(screen, **fields):
    for name, value in fields.items():
        screen.query_one(f"#field-{name}").value = value


@pytest.mark.slow
def test_train_screen_starts_a_run_and_the_charts_gain_points(tmp_path):
    async def go():
        app = LocalRLApp(runs_dir=tmp_path / "runs", data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            _fill(screen, steps="3", prompts_per_step="4", group_size="4", flags="--eval-size 0")
            await pilot.click("#start")
            reward = screen.query_one("#chart-reward_mean", MetricChart)
            await wait_for(pilot, lambda: len(reward.values) >= 1)  # a point while the run is live
            await wait_for(pilot, lambda: not screen.running and "finished" in screen.status)
            await pilot.pause(0.3)
            assert len(reward.values) == 3
            assert len(screen.query_one("#chart-peak_mem_mb", MetricChart).values) == 3
            means = screen.query_one("#reward-means")  # each reward apart, as metrics.jsonl logs it
            assert means.display and "numeric_match" in str(means.render()) and "format_reward" in str(means.render())
            return screen.run_dir

    run_dir = run(go())
    assert run_dir.parent == tmp_path / "runs"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    assert any((run_dir / "checkpoints").iterdir())


@pytest.mark.slow
def test_the_train_screen_says_what_happens_before_the_first_step(tmp_path):
    """Between Start and the first step: loading the model, then the held-out evaluation with its progress."""
    async def go():
        app = LocalRLApp(runs_dir=tmp_path / "runs", data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            _fill(screen, steps="1", prompts_per_step="2", group_size="2",
                  flags="--eval-size 48 --eval-batch-size 4")
            await pilot.click("#start")
            bar = screen.query_one("#progress")
            seen = set()

            def watch():
                text = str(screen.query_one("#run-status").render())
                if "loading tiny-arith" in text:
                    seen.add("loading")
                if "evaluating before training" in text and bar.total == 48 and 0 < bar.progress < 48:
                    seen.add("evaluating")
                return not screen.running

            await wait_for(pilot, watch, step=0.05)
            assert seen == {"loading", "evaluating"} and "finished" in screen.status

    run(go())


@pytest.mark.parametrize("fields, message, invalid", [
    ({"model": "/no/such/model"}, "no such directory", "model"),
    ({"group_size": "1"}, "group_size", "group_size"),
    ({"flags": "--no-such-flag 3"}, "unknown flag '--no-such-flag'", "flags"),
    ({"flags": "--beta inf"}, "config field beta: must be a finite number", "flags"),
    ({"steps": "many"}, "config field steps: expected int", "steps"),
])
def test_bad_form_input_is_shown_inline_and_starts_nothing(tmp_path, fields, message, invalid):
    async def go():
        app = LocalRLApp(runs_dir=tmp_path / "runs", data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            _fill(screen, **fields)
            await pilot.click("#start")
            await pilot.pause(0.2)
            assert message in str(screen.query_one("#form-error").render())
            assert screen.query_one(f"#field-{invalid}").has_class("-invalid")
            assert screen.proc is None

    run(go())
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_crashed_training_subprocess_is_shown_not_fatal(tmp_path):
    async def go():
        app = LocalRLApp(runs_dir=tmp_path / "runs", data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            _fill(screen, steps="2", prompts_per_step="2", group_size="2",
                  flags="--eval-size 0 --reward tests.test_tui:exploding_reward")
            await pilot.click("#start")
            await wait_for(pilot, lambda: "failed" in screen.status)
            assert "exit 2" in screen.status and "reward exploded" in screen.status
            assert app.is_running  # still up: switch screens and back
            await pilot.press("f2", "f1")
            assert app.screen is screen

    run(go())


def exploding_reward(completions, **columns):
    """Passes the preflight's probe (2 made-up completions), fails in the first step."""
    if len(completions) > 2:
        raise RuntimeError("reward exploded")
    return [0.0] * len(completions)


def test_attach_watches_a_run_started_elsewhere(tmp_path):
    from localrl.config import TrainConfig
    from localrl.training.loop import train

    cfg = TrainConfig(model="tiny-arith-conf", calibration_weight=1.0, steps=2, prompts_per_step=2, group_size=2,
                      eval_size=8, run_dir=str(tmp_path / "run"))
    result = train(cfg, log=lambda *_: None)

    async def go():
        app = LocalRLApp(attach=tmp_path / "run", data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            await wait_for(pilot, lambda: len(screen.query_one("#chart-kl", MetricChart).values) == 2, timeout=10)
            bar = screen.query_one("#progress")
            assert (bar.total, bar.progress) == (2, 2)
            assert "attached" in screen.status
            text = str(screen.query_one("#run-status").render())  # a calibration run's evaluations show ECE
            assert f"eval after: {result.eval_after['accuracy']:.1%} (ECE {result.eval_after['ece']:.3f})" in text

    run(go())


@pytest.mark.parametrize("fields", [{"beta": 0.0}, {"env": "shell", "model": "tiny-shell", "max_new_tokens": 48}],
                         ids=["beta-0", "env-shell"])
@pytest.mark.slow
def test_attach_survives_every_record_of_runs_whose_kl_is_null(tmp_path, fields):
    """A --beta 0 run and an agent run write ``"kl": null`` in every step (and the agent run's evaluations
    count successes): the charts skip what is missing, and the app lives to show the whole run."""
    from localrl.config import TrainConfig
    from localrl.metrics import read_metrics
    from localrl.runs import Run
    from localrl.training.loop import train

    cfg = TrainConfig(**{"steps": 2, "prompts_per_step": 2, "group_size": 2, "eval_size": 4,
                         "run_dir": str(tmp_path / "run"), **fields})
    train(cfg, log=lambda *_: None)
    records = [r for r in read_metrics(Run(tmp_path / "run").metrics_path) if r["kind"] == "train"]
    if fields.get("beta") == 0.0:
        assert records and all(r.get("kl") is None for r in records)  # what made the app die

    async def go():
        app = LocalRLApp(attach=tmp_path / "run", data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            await wait_for(pilot, lambda: len(screen.query_one("#chart-reward_mean", MetricChart).values) == 2,
                           timeout=10)
            if fields.get("beta") == 0.0:
                assert screen.query_one("#chart-kl", MetricChart).values == []
            bar = screen.query_one("#progress")
            assert (bar.total, bar.progress) == (2, 2) and "attached" in screen.status
            assert "eval after" in str(screen.query_one("#run-status").render())

    run(go())


def test_attach_survives_records_with_null_and_missing_fields(tmp_path):
    """Every record kind, with its optional fields null or left out, and lines that are no record at all: nothing
    in a metrics file kills the app."""
    from localrl.config import TrainConfig
    from localrl.config_io import to_toml
    from localrl.runs import Run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(to_toml(TrainConfig(run_dir=str(run_dir), steps=3)))
    records = [{"kind": "status", "message": "loading"}, {"kind": "status", "message": "evaluating", "done": None,
                                                         "total": None},
               {"kind": "eval", "when": "before", "accuracy": None}, {"kind": "eval", "when": "before"},
               {"kind": "train", "step": 1, "reward_mean": 0.5, "kl": None, "loss": None, "rewards": {"a": None}},
               {"kind": "train", "step": 2, "reward_mean": None, "accuracy": 0.5, "rewards": {}},
               {"kind": "warning", "message": "no learning signal"}, {"kind": "checkpoint"},
               {"kind": "train", "step": 3, "reward_mean": 1.0, "kl": 0.01, "ece": None}]
    damaged = [b"\xff\xfe not UTF-8", b"5", b"[1,2]", b'{"step": "two", "rewards": 5}', b'{"kind": "train", "step": "two"}',
               b'{"kind": "train", "step": 4, "reward_mean": "high"}', b'{"kind": 7}']  # the probe's lines
    lines = [json.dumps(r).encode() for r in records]
    Run(run_dir).metrics_path.write_bytes(b"\n".join(lines[:4] + damaged + lines[4:]) + b"\n")

    async def go():
        app = LocalRLApp(attach=run_dir, data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            await wait_for(pilot, lambda: len(screen.query_one("#chart-reward_mean", MetricChart).values) == 2,
                           timeout=10)
            assert screen.query_one("#chart-kl", MetricChart).values == [0.01]
            assert screen.query_one("#progress").progress == 3
            assert "warning" in str(screen.query_one("#run-status").render())

    run(go())


# -- Chat ----------------------------------------------------------------------------------


def _assistant_messages(screen) -> list[Message]:
    return [m for m in screen.query(Message) if m.role == "assistant"]


def test_chat_streams_a_reply_from_the_builtin_model_and_saves_it(tmp_path, builtin_model):
    async def go():
        app = LocalRLApp(model=str(builtin_model), data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.chat_model is not None, timeout=60)
            screen = app.screen
            assert type(screen).__name__ == "ChatScreen"
            screen.query_one("#prompt").value = "What is 12 + 34?"
            await pilot.press("enter")
            await wait_for(pilot, lambda: _assistant_messages(screen))
            reply = _assistant_messages(screen)[0]
            await wait_for(pilot, lambda: screen.streaming is None)
            await pilot.pause(0.2)
            text = reply.text
            assert "<answer>" in text and "</answer>" in text
            think = reply.query_one(".think-text").render()
            assert str(think).strip() and reply.query_one(".think").display  # the thinking is shown apart
            assert "<think>" not in str(reply.query_one(".body").render())
            saved = list((tmp_path / "data" / "chats").glob("*.json"))
            assert len(saved) == 1
            data = json.loads(saved[0].read_text())
            assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
            assert data["messages"][1]["content"] == text
            # reopen it in a fresh conversation
            await pilot.press("ctrl+n")
            await pilot.pause(0.1)
            assert not list(screen.query(Message))
            await pilot.press("ctrl+o")
            await pilot.pause(0.2)
            await pilot.press("enter")
            await pilot.pause(0.2)
            assert [m.text for m in screen.query(Message)] == ["What is 12 + 34?", text]

    run(go())


class SlowModel(ScriptedModel):
    def stream(self, messages, max_tokens=512, temperature=0.0, cancel=None):
        for _ in range(2000):
            if cancel is not None and cancel.is_set():
                return
            time.sleep(0.01)
            yield "x"


def test_esc_cancels_a_reply(tmp_path):
    async def go():
        app = LocalRLApp(model=SlowModel([]), data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            screen.query_one("#prompt").value = "go on forever"
            await pilot.press("enter")
            await wait_for(pilot, lambda: _assistant_messages(screen) and len(_assistant_messages(screen)[0].text) > 3)
            await pilot.press("escape")
            await wait_for(pilot, lambda: screen.streaming is None, timeout=5)
            reply = _assistant_messages(screen)[0]
            assert reply.note == "cancelled" and len(reply.text) < 2000

    run(go())


# -- Agent ---------------------------------------------------------------------------------


async def _agent_task(pilot, app, task: str):
    await pilot.press("f3")
    screen = app.screen
    screen.query_one("#task").value = task
    screen.query_one("#task").focus()
    await pilot.press("enter")
    await wait_for(pilot, lambda: screen.query_one("#approval").display, timeout=10)
    return screen


async def _agent_done(pilot, screen):
    await wait_for(pilot, lambda: "done" in str(screen.query_one("#agent-status").render()), timeout=30)


def test_agent_runs_an_approved_command_and_the_model_sees_its_output(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    model = ScriptedModel([tool_call("echo hello > made.txt && cat made.txt"), "The file says hello."])

    async def go():
        app = LocalRLApp(model=model, workdir=work, data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = await _agent_task(pilot, app, "make a file")
            assert screen.query_one("#command").value == "echo hello > made.txt && cat made.txt"
            assert not (work / "made.txt").exists()  # nothing runs before approval
            await pilot.click("#approve")
            await _agent_done(pilot, screen)
            return screen.transcript

    transcript = run(go())
    assert (work / "made.txt").read_text() == "hello\n"
    tool = next(e for e in transcript if e["role"] == "tool")
    assert tool["command"] == "echo hello > made.txt && cat made.txt" and tool["exit_code"] == 0
    assert "hello" in tool["content"]
    assert "hello" in model.seen[1][-1]["content"] and "<tool_response>" in model.seen[1][-1]["content"]
    saved = json.loads(next((tmp_path / "data" / "agent").glob("*.json")).read_text())
    assert saved["transcript"] == transcript


def test_agent_runs_the_command_as_edited(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    model = ScriptedModel([tool_call("rm -rf important"), "ok"])
    (work / "important").mkdir()

    async def go():
        app = LocalRLApp(model=model, workdir=work, data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = await _agent_task(pilot, app, "tidy up")
            screen.query_one("#command").value = "echo edited > edited.txt"
            await pilot.press("enter")  # Enter in the command box approves it
            await _agent_done(pilot, screen)

    run(go())
    assert (work / "important").is_dir()
    assert (work / "edited.txt").read_text() == "edited\n"


def test_always_remembers_a_prefix_for_the_directory_and_dangerous_lines_are_still_asked(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    model = ScriptedModel([tool_call("echo one >> log.txt"), tool_call("echo two >> log.txt"),
                           tool_call("sudo echo three"), "done"])

    async def go():
        app = LocalRLApp(model=model, workdir=work, data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = await _agent_task(pilot, app, "write a log")
            await pilot.click("#always")  # allow `echo` here from now on: the second echo is not asked about
            await wait_for(pilot, lambda: screen.query_one("#approval").display and
                           screen.query_one("#command").value == "sudo echo three", timeout=30)
            await pilot.click("#reject")
            await _agent_done(pilot, screen)
            return screen.transcript

    transcript = run(go())
    assert (work / "log.txt").read_text() == "one\ntwo\n"
    assert any(e["content"].startswith("allowed without asking: you always allow `echo` here") for e in transcript)
    from localrl.agent.approvals import Approvals

    assert Approvals(work, tmp_path / "data" / "approvals.json").decide("echo x")[0] == "allow"


def test_a_rejected_command_never_runs(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    model = ScriptedModel([tool_call("touch should_not_exist"), "Understood."])

    async def go():
        app = LocalRLApp(model=model, workdir=work, data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = await _agent_task(pilot, app, "touch a file")
            await pilot.click("#reject")
            await _agent_done(pilot, screen)
            return screen.transcript

    transcript = run(go())
    assert list(work.iterdir()) == []
    assert any(e["role"] == "tool" and e["content"].startswith("rejected") for e in transcript)
    assert "rejected" in model.seen[1][-1]["content"]


def test_streamed_text_survives_a_worker_feeding_while_the_screen_draws():
    """``feed`` runs on worker threads while the UI thread draws: no piece may be lost or reordered."""
    import threading

    message = Message("assistant", streaming=True)
    pieces = [f"{i} " for i in range(50_000)]

    def worker():
        for piece in pieces:
            message.feed(piece)

    thread = threading.Thread(target=worker)
    thread.start()
    while thread.is_alive():
        message.flush()
    message.flush()
    assert message.text == "".join(pieces)


# -- what a person trips on ------------------------------------------------------------------


def test_after_an_approval_typing_goes_to_the_task_and_dir_is_never_overwritten(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    model = ScriptedModel([tool_call("echo hi"), "done."])

    async def go():
        app = LocalRLApp(model=model, workdir=work, data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = await _agent_task(pilot, app, "say hi")
            await pilot.press("ctrl+y")
            await _agent_done(pilot, screen)
            assert app.focused is screen.query_one("#task")  # not the hidden approval panel
            await pilot.press("l", "s")
            assert screen.query_one("#task").value == "ls"
            screen.query_one("#workdir").focus()  # as Tab from the task lands there
            await pilot.pause()
            await pilot.press("x")
            assert screen.query_one("#workdir").value == f"{work}x"  # typed after it, not replacing it

    run(go())


def test_a_failed_load_says_which_model_still_answers(tmp_path):
    async def go():
        app = LocalRLApp(model=ScriptedModel(["hi"]), data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            app.chat_source = "scripted"
            app.load_model(str(tmp_path / "missing.gguf"))
            await wait_for(pilot, lambda: "cannot load" in app.model_status)
            assert "still talking to scripted" in app.model_status, app.model_status
            assert app.chat_model is not None

    run(go())


def test_chat_offers_the_newest_run_and_the_footer_shows_quit(tmp_path):
    runs = tmp_path / "runs"
    for name, age in (("older", 100), ("newer", 0)):
        step = runs / name / "checkpoints" / "step-000001"
        step.mkdir(parents=True)
        (runs / name / "config.toml").write_text("")
        os.utime(step, (time.time() - age, time.time() - age))

    async def go():
        app = LocalRLApp(runs_dir=runs, data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            assert "Quit" in str(app.screen.query_one("Footer").render()) or any(
                "Quit" in str(w.render()) for w in app.screen.query("FooterKey"))
            await pilot.press("f2")
            await pilot.pause()
            assert app.screen.query_one("#source").value == str(runs / "newer")

    run(go())


def test_an_emptied_numeric_field_is_an_error_not_a_default_run(tmp_path):
    async def go():
        app = LocalRLApp(runs_dir=tmp_path / "runs", data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            assert screen.query_one("#field-steps").placeholder.startswith("default ")
            _fill(screen, steps="")
            await pilot.click("#start")
            await pilot.pause(0.2)
            assert "Steps: empty; enter a value (the default is" in str(screen.query_one("#form-error").render())
            assert screen.query_one("#field-steps").has_class("-invalid") and screen.proc is None

    run(go())


def test_a_spoofed_command_is_shown_with_its_escapes_written_out_and_runs_as_approved(tmp_path):
    from tests.test_visible import REAL, SPOOF

    work = tmp_path / "work"
    work.mkdir()

    async def go():
        app = LocalRLApp(model=ScriptedModel([SPOOF, "done"]), workdir=work, data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            screen = await _agent_task(pilot, app, "list")
            proposed = str(screen.query_one("#proposed").render())
            box = screen.query_one("#command").value
            reply = str(_assistant_messages(screen)[0]._body.render())
            assert not (work / "HIDDEN").exists()
            await pilot.click("#approve")
            await _agent_done(pilot, screen)
            return proposed, box, reply, screen.transcript

    proposed, box, reply, transcript = run(go())
    assert "ls -la; touch HIDDEN #\\x1b[30D\\x1b[K" in proposed and "WARNING" in proposed
    assert box == "ls -la; touch HIDDEN #\\x1b[30D\\x1b[K" and "\x1b" not in reply and "\\x1b8\\x1b[J" in reply
    assert (work / "HIDDEN").exists()  # approved as shown: the exact proposed bytes ran
    assert next(e for e in transcript if e["role"] == "tool" and "command" in e)["command"] == REAL
