"""Recorded agent sessions (``localrl agent --record``): a scripted person's decisions (edit, reject, approve, a
remembered rule) as the log keeps them, secrets planted in the environment and in files' contents never written,
the file private and whole, and the command line's recording with the built-in agent."""

from __future__ import annotations

import io
import json
import os
import stat

import pytest

from localrl.agent.approvals import Approvals
from localrl.agent.session import run_agent, terminal_ask, terminal_rating
from localrl.agent.session_log import SessionLog, mask, secret_values
from tests.helpers import ScriptedModel, localrl, tool_call

ENV_SECRET = "tok-9f8e7d6c5b4a3921"  # an environment variable's value, written into a file without its name
FILE_PASSWORD = "hunter2hunter2"
GITHUB_TOKEN = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2"


def test_a_recorded_session_keeps_each_decision_and_masks_the_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALRL_DEPLOY_TOKEN", ENV_SECRET)
    work = tmp_path / "work"
    work.mkdir()
    (work / "deploy.txt").write_text(f"the deploy uses {ENV_SECRET} today\n")
    (work / ".env").write_text(f"DB_PASSWORD={FILE_PASSWORD}\nGH={GITHUB_TOKEN}\nmode=fast\n")
    model = ScriptedModel([tool_call("rm deploy.txt"), tool_call("cat deploy.txt"), tool_call("sudo cat .env"),
                           tool_call("ls -a"), "<answer>2 files</answer>"])
    # the person rejects the rm, approves the cat, edits the sudo away and always allows ls (remembered from now on)
    person = io.StringIO("n\ny\ne\ncat .env\na\n4\n")
    out = io.StringIO()
    log = SessionLog(tmp_path / "sessions")
    messages = run_agent(model, "What is in this folder?", work, terminal_ask(person, out), out, system=None,
                         approvals=Approvals(work, store=tmp_path / "a.json"), log=log, rate=terminal_rating(person, out))
    assert "recording this session to" in out.getvalue()
    raw = log.path.read_text()
    for secret in (ENV_SECRET, FILE_PASSWORD, GITHUB_TOKEN):
        assert secret in json.dumps(messages)  # the model saw them (the sandbox ran the commands) ...
        assert secret not in raw  # ... the log never holds them
    [record] = [json.loads(line) for line in raw.splitlines()]
    assert record["task"] == "What is in this folder?" and record["rating"] == 4
    assert record["answer"] == "<answer>2 files</answer>" and record["model"] == "scripted"
    turns = record["turns"]
    assert [t["decision"] for t in turns] == ["rejected", "approved", "edited", "approved"]
    assert [t["proposed"] for t in turns] == ["rm deploy.txt", "cat deploy.txt", "sudo cat .env", "ls -a"]
    assert [t["command"] for t in turns] == [None, "cat deploy.txt", "cat .env", "ls -a"]
    assert "the deploy uses [masked] today" in turns[1]["output"]
    assert "DB_PASSWORD=[masked]" in turns[2]["output"] and "mode=fast" in turns[2]["output"]
    for t in turns:  # each turn points at the model's reply that proposed it
        assert record["messages"][t["message"]]["role"] == "assistant"
        assert t["proposed"] in record["messages"][t["message"]]["content"]
    assert (work / "deploy.txt").exists()  # the rejected rm never ran
    assert stat.S_IMODE(log.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(log.path.parent.stat().st_mode) == 0o700


def test_masking_by_name_shape_and_value():
    secrets = secret_values({"OPENAI_API_KEY": "sk-live-123456", "HOME": "/home/x", "PWD_HINT": "", "my_token": "abcd"})
    assert secrets == ["sk-live-123456", "abcd"]
    text = ('export OPENAI_API_KEY="sk-live-123456"; password: letmein; token=xyz; key is sk-live-123456; '
            'AWS AKIAABCDEFGHIJKLMNOP; keyboard=qwerty; path /home/x')
    assert mask(text, secrets) == ('export OPENAI_API_KEY="[masked]"; password: [masked]; token=[masked]; key is '
                                   '[masked]; AWS [masked]; keyboard=qwerty; path /home/x')


def test_a_long_output_is_cut_and_an_unwritable_place_is_one_line(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    (work / "big.txt").write_text("x" * 20000)
    log = SessionLog(tmp_path / "s")
    run_agent(ScriptedModel([tool_call("cat big.txt"), "ok"]), "read it", work,
              terminal_ask(io.StringIO("y\n"), io.StringIO()), io.StringIO(), system=None,
              approvals=Approvals(work, store=tmp_path / "a.json"), log=log)
    [record] = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert len(record["turns"][0]["output"]) < 4100 and "characters not kept" in record["turns"][0]["output"]
    (tmp_path / "file").write_text("")
    from localrl.errors import UserError

    with pytest.raises(UserError, match="--record .*file: not a directory"):
        SessionLog(tmp_path / "file")
    with pytest.raises(UserError, match="--record .*file/sessions: cannot be written"):  # before an episode, not after
        SessionLog(tmp_path / "file" / "sessions").check()
    (tmp_path / "locked").mkdir(mode=0o500)
    if os.geteuid() != 0:  # (root writes anyway)
        with pytest.raises(UserError, match="--record .*locked/s: cannot be written"):
            SessionLog(tmp_path / "locked" / "s").check()


@pytest.mark.slow
def test_localrl_agent_records_the_built_in_agents_session(tmp_path):
    """The command line, with the built-in agent (tiny-shell): the person approves whatever it proposes and rates
    the session 5; one line is recorded, and said so at the start."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("a\nb\nc\n")
    proc = localrl("agent", "tiny-shell", "How many lines are in notes.txt?", "--workdir", work, "--max-turns", "1",
                   "--record", tmp_path / "sessions", input="y\n5\n")
    assert proc.returncode == 0, proc.stderr
    assert "recording this session to" in proc.stdout
    [record] = [json.loads(line) for line in (tmp_path / "sessions" / "sessions.jsonl").read_text().splitlines()]
    assert record["task"] == "How many lines are in notes.txt?" and record["rating"] == 5
    assert all(t["decision"] in ("approved", "allowed") for t in record["turns"])
    proc = localrl("agent", "tiny-shell", "x", "--workdir", work, "--record")
    assert proc.returncode == 2 and "agent --record: tiny-shell is not a run; name the directory" in proc.stderr


def test_sessions_are_preference_pairs_edits_and_approvals_at_one_state(tmp_path):
    from localrl.data.preferences import session_pairs

    task = [{"role": "user", "content": "clean up"}]
    proposed = tool_call("sudo rm -r build")
    edit = {"messages": task + [{"role": "assistant", "content": proposed}], "turns": [
        {"message": 1, "proposed": "sudo rm -r build", "decision": "edited", "command": "rm -ri build"}]}
    approved = {"messages": task + [{"role": "assistant", "content": tool_call("ls")}],
                "turns": [{"message": 1, "proposed": "ls", "decision": "approved", "command": "ls"}]}
    rejected = {"messages": task + [{"role": "assistant", "content": tool_call("rm -rf .")}],
                "turns": [{"message": 1, "proposed": "rm -rf .", "decision": "rejected", "command": None}]}
    pairs = session_pairs([("s:1", edit), ("s:2", approved), ("s:3", rejected)])
    assert pairs == [
        {"prompt": task, "chosen": tool_call("rm -ri build"), "rejected": proposed},  # the edit, as the model writes
        {"prompt": task, "chosen": tool_call("ls"), "rejected": tool_call("rm -rf .")},  # one state, two decisions
    ]
    from localrl.errors import UserError

    with pytest.raises(UserError, match="s:4: a turn's 'message' must index one of the model's replies"):
        session_pairs([("s:4", {**edit, "turns": [{"message": 0, "decision": "edited"}]})])
    strings = {**edit, "messages": [str(m) for m in edit["messages"]]}  # (an AttributeError)
    with pytest.raises(UserError, match="s:5: a turn's 'message' must index one of the model's replies"):
        session_pairs([("s:5", strings)])


@pytest.mark.slow
def test_dpo_learns_a_persons_edits_from_recorded_sessions(tmp_path):
    """The built-in agent's sessions, recorded: a person who always edits `cat FILE` to `head -n 5 FILE`. DPO on
    the sessions' pairs (``--data`` the sessions directory) moves the agent's own preference to the edited form on
    held-out pairs."""
    import random

    from localrl.training.loop import train
    from tests.helpers import QUIET, small

    log = SessionLog(tmp_path / "sessions")  # (recorded through the log's API: the commands' runs are not the point)
    rng = random.Random(0)
    for i in range(40):
        name = f"{rng.choice(['notes', 'data', 'log', 'todo'])}{i}.txt"
        episode = log.begin(f"How many lines are in {name}?", "tiny-shell", tmp_path)
        messages = [{"role": "user", "content": episode.task}, {"role": "assistant", "content": tool_call(f"cat {name}")}]
        episode.turn(1, f"cat {name}", "edited", f"head -n 5 {name}", 0, "a\nb")
        log.end(episode, messages + [{"role": "user", "content": "<tool_response>\na\nb\n</tool_response>"},
                                     {"role": "assistant", "content": "<answer>2</answer>"}])
    cfg = small(tmp_path / "run", model="tiny-shell", objective="dpo", sampler="preferences",
                data=str(tmp_path / "sessions"), beta=0.1, loss_type="sigmoid", steps=6, prompts_per_step=8,
                eval_size=8)
    result = train(cfg, **QUIET)
    assert result.eval_before["n"] == 4 and result.eval_before["accuracy"] == 0.5
    assert result.eval_after["accuracy"] == 1.0 and result.eval_after["logp_accuracy"] == 1.0


def test_the_terminal_uis_agent_records_when_the_switch_is_on(tmp_path, monkeypatch):
    """The Agent screen, driven by a scripted person: Record on, a secret planted in a file the model reads, the
    command edited before it runs, the task rated 4; the episode's line in the data directory's sessions/ holds the
    edit, masked, and the rating. A second task left unrated is written, rating null, when a third starts."""
    from tests.helpers import wait_for
    from tests.test_tui import SIZE, LocalRLApp, _agent_task, run as run_async

    monkeypatch.setenv("LOCALRL_DEPLOY_TOKEN", ENV_SECRET)
    work = tmp_path / "work"
    work.mkdir()
    (work / "deploy.txt").write_text(f"uses {ENV_SECRET}\n")
    model = ScriptedModel([tool_call("sudo cat deploy.txt"), "It is a deploy file."])

    async def go():
        app = LocalRLApp(model=model, workdir=work, data_dir=tmp_path / "data")
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("f3")
            app.screen.query_one("#record").value = True
            screen = await _agent_task(pilot, app, "what is deploy.txt?")
            screen.query_one("#command").value = "cat deploy.txt"
            await pilot.press("enter")
            await wait_for(pilot, lambda: screen.query_one("#rating").display, timeout=30)
            assert not log.exists()  # written once the rating is answered
            await pilot.click("#rate-4")
            await wait_for(pilot, lambda: log.exists(), timeout=10)
            lines = [log.read_text()]
            for task in ("anything else?", "and now?"):  # the second is left unrated: the third writes it
                screen.query_one("#task").value = task
                screen.query_one("#task").focus()
                await pilot.press("enter")
                await wait_for(pilot, lambda: screen.query_one("#rating").display, timeout=30)
            lines.append(log.read_text())
            return screen.transcript, lines

    log = tmp_path / "data" / "sessions" / "sessions.jsonl"
    transcript, (raw, later) = run_async(go())
    assert any("recording this session to" in e["content"] for e in transcript)
    assert any(e["content"] == f"recorded to {log}, rated 4" for e in transcript)
    assert ENV_SECRET not in raw
    [record] = [json.loads(line) for line in raw.splitlines()]
    assert record["rating"] == 4
    assert [(r["task"], r["rating"]) for r in map(json.loads, later.splitlines())] == [
        ("what is deploy.txt?", 4), ("anything else?", None)]
    assert [(t["proposed"], t["decision"], t["command"]) for t in record["turns"]] == [
        ("sudo cat deploy.txt", "edited", "cat deploy.txt")]
    assert "uses [masked]" in record["turns"][0]["output"] and record["answer"] == "It is a deploy file."
