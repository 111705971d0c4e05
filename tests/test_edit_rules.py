"""A person learned from their recorded edits (``localrl.agent.edit_rules``): hand-worked rules of single edits, the
learned person against the scripted one on held-out commands, the ``shell_person`` environment's reward in the real
sandbox, and the agent session revising proposals as the person's edits would (``--follow-edits``)."""

from __future__ import annotations

import io
import json
import random

import pytest

from localrl.agent.approvals import Approvals
from localrl.agent.edit_rules import SLOT, EditRules, Rule, apply_rule, rules_of_edit
from localrl.agent.scripted_person import RULES, ScriptedPerson
from localrl.agent.session import run_agent
from localrl.agent.session_log import SessionLog
from localrl.envs.shell_tasks import held_out_tasks, sample_tasks
from localrl.errors import UserError
from tests.helpers import ScriptedModel, localrl, record_sessions, tool_call


def test_the_rules_of_one_edit():
    assert rules_of_edit("wc -l < a.txt", "timeout 10 wc -l < a.txt") == [Rule(None, (), ("timeout", "10"))]
    assert rules_of_edit("cat a | wc -l", "cat a | wc --lines") == [Rule("wc", ("-l",), ("--lines",))]
    # a word that is no option and reappears inside the edit is a slot
    assert rules_of_edit("head -n 3 f.txt", "head --lines=3 f.txt") == [
        Rule("head", ("-n", f"{SLOT}1"), (f"--lines={SLOT}1",))]
    # an inserted word stays with the word before it; a removed one is a change in its own command
    assert rules_of_edit("rm old.txt", "rm -i old.txt") == [Rule("rm", ("rm",), ("rm", "-i"))]
    assert rules_of_edit("sudo ls", "ls") == [Rule("sudo", ("sudo",), ())]


def test_edits_of_two_changes_and_a_prefix_with_an_insert_give_the_rules_written_here():
    """Each change's tool is the proposed line's, wherever the edit moved the words (read from the edited line, the
    wc rule was lost and the second edit raised IndexError)."""
    assert rules_of_edit("head -n 3 a.txt | wc", "head --lines=3 a.txt | wc -l") == [
        Rule("head", ("-n", f"{SLOT}1"), (f"--lines={SLOT}1",)), Rule("wc", ("wc",), ("wc", "-l"))]
    assert rules_of_edit("ls", "timeout 5 ls -la") == [Rule(None, (), ("timeout", "5")),
                                                      Rule("ls", ("ls",), ("ls", "-la"))]
    assert rules_of_edit("cat a | sort | uniq", "cat a | sort -r | uniq -c") == [
        Rule("sort", ("sort",), ("sort", "-r")), Rule("uniq", ("uniq",), ("uniq", "-c"))]


def test_a_rule_applies_where_it_matches_once_and_only_in_its_tool():
    slot = Rule("head", ("-n", f"{SLOT}1"), (f"--lines={SLOT}1",))
    assert apply_rule(slot, "head -n 7 x | tail -n 2") == "head --lines=7 x | tail -n 2"
    insert = Rule("rm", ("rm",), ("rm", "-i"))
    assert apply_rule(insert, "rm a && rm -i b") == "rm -i a && rm -i b"  # never doubled
    prefix = Rule(None, (), ("timeout", "10"))
    assert apply_rule(prefix, "wc -l a") == "timeout 10 wc -l a"
    assert apply_rule(prefix, "timeout 10 wc -l a") == "timeout 10 wc -l a"
    assert apply_rule(Rule("wc", ("-l",), ("--lines",)), "grep -l x * ; echo 'wc -l'") == "grep -l x * ; echo 'wc -l'"


def test_an_approved_command_drops_a_rule_it_contradicts():
    rules = EditRules.learn([("grep -c x a", "grep --count x a"), ("rm a", "rm -i a"), ("rm -f b", None)])
    # the person let `rm -f b` run as it was: "rm -> rm -i" is not their rule
    assert [r.describe() for r in rules.rules] == ["grep: '-c' -> '--count'"]
    assert (rules.edits, rules.approvals, rules.dropped) == (2, 1, 1)
    assert rules.approves("grep --count y b") and not rules.approves("grep -c y b")


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_learned_person_edits_held_out_commands_as_the_person_does(rule):
    """Learned from the person's decisions on 200 training tasks' commands (the expert's and the careless ones), the
    rules edit every held-out task's commands as the scripted person does: the same edit, and approval where it
    approves."""
    person = RULES[rule]
    train = [c for t in sample_tasks(random.Random("approvals-0"), 200) for c in (*t.solution, *t.slip)]
    rules = EditRules.learn([(c, None if person(c) == c else person(c)) for c in train])
    held = [c for t in held_out_tasks(100) for c in (*t.solution, *t.slip)]
    assert sum(person(c) != c for c in held) >= 50  # the rule is about many of them
    assert [rules.apply(c) for c in held] == [person(c) for c in held]


def test_the_person_env_takes_off_the_share_of_commands_the_person_would_edit(tmp_path):
    """env shell_person in the real sandbox: the expert's commands solve a task; spelt long they solve it with the
    person's approval (reward 1), spelt short the reward loses PERSON_WEIGHT x the share the person would edit."""
    from localrl.config import TrainConfig
    from localrl.envs import environment_for
    from localrl.envs.shell import ShellEnv, expert_answer, expert_call
    from localrl.envs.shell_person import PERSON_WEIGHT

    sessions = record_sessions(tmp_path, "long-options", n=24)
    setup = environment_for(TrainConfig(env="shell_person", person_sessions=str(sessions), eval_size=20).validate())
    person = RULES["long-options"]
    task = next(t for t in setup.held_out if any(person(c) != c for c in t.solution))
    edited = sum(person(c) != c for c in task.solution) / len(task.solution)
    for commands, want in ((task.solution, 1 - PERSON_WEIGHT * edited), ([person(c) for c in task.solution], 1.0)):
        env = setup.make_env(lambda _: task)
        env.reset(0)
        for command in commands:
            observation, _ = env.step(expert_call(command))
        env.step(expert_answer(observation, task))
        assert ShellEnv.reward(env) == 1.0  # solved either way
        assert env.reward() == pytest.approx(want)
        env.close()
    # the expert sft learns from: the shell's, each command in the person's form
    env = setup.make_env(lambda _: task)
    score, turns = setup.expert(env, 0)
    assert score == 1.0 and [a for a, _ in turns[:-1]] == [expert_call(person(c)) for c in task.solution]
    env.close()


def test_bad_sessions_for_the_person_env_are_one_line(tmp_path):
    from localrl.config import TrainConfig
    from localrl.envs import environment_for
    from localrl.training.settings import check_config

    with pytest.raises(UserError, match="config field person_sessions: env shell_person learns the person"):
        check_config(TrainConfig(env="shell_person"))
    with pytest.raises(UserError, match="config field person_sessions: needs env shell_person"):
        check_config(TrainConfig(env="shell", person_sessions=str(tmp_path)))
    with pytest.raises(UserError, match="config field person_sessions: .*no recorded sessions"):
        environment_for(TrainConfig(env="shell_person", person_sessions=str(tmp_path)).validate())
    log = SessionLog(tmp_path / "s")
    work = tmp_path / "w"
    work.mkdir()
    run_agent(ScriptedModel([tool_call("ls"), "ok"]), "list", work, ScriptedPerson(RULES["long-options"]).ask,
              io.StringIO(), system=None, approvals=Approvals(work, store=tmp_path / "a.json"), log=log)
    with pytest.raises(UserError, match="edits teach no rule"):
        environment_for(TrainConfig(env="shell_person", person_sessions=str(log.directory)).validate())
    (tmp_path / "five.jsonl").write_text('{"messages": [], "turns": 5}\n')  # (a TypeError in the rules' reader)
    with pytest.raises(UserError, match=r"five.jsonl:1: a session's 'turns' must be a list"):
        environment_for(TrainConfig(env="shell_person", person_sessions=str(tmp_path / "five.jsonl")).validate())


def test_the_agent_follows_the_persons_edits(tmp_path):
    """run_agent with the learned person as the harness (``localrl agent --follow-edits``): the proposal the person
    is asked about is the revised one, so they approve it; the conversation holds the model's reply and the output of
    what ran."""
    sessions = record_sessions(tmp_path, "timeout", n=8)
    rules = EditRules.from_sessions(sessions)
    assert [r.describe() for r in rules.rules] == ["every line starts with 'timeout 10'"]
    person = ScriptedPerson(RULES["timeout"])
    work = tmp_path / "w"
    work.mkdir()
    (work / "a.txt").write_text("1\n2\n3\n")
    out = io.StringIO()
    messages = run_agent(ScriptedModel([tool_call("wc -l < a.txt"), "<answer>3</answer>"]), "count", work,
                         person.ask, out, system=None, approvals=Approvals(work, store=tmp_path / "a.json"),
                         revise=rules.apply)
    assert (person.asked, person.approved) == (1, 1)
    assert "[revised by your past edits: timeout 10 wc -l < a.txt]" in out.getvalue()
    assert "wc -l < a.txt" in messages[1]["content"] and "timeout" not in messages[1]["content"]  # the model's own
    assert "3" in messages[2]["content"]  # the output of what ran


@pytest.mark.slow
def test_agent_follow_edits_on_the_command_line(tmp_path):
    sessions = record_sessions(tmp_path, "long-options", n=12)
    proc = localrl("agent", "tiny-shell", "How many lines are in a.txt?", "--workdir", str(tmp_path),
                   "--follow-edits", str(sessions), "--max-turns", "1", input="n\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "following your edits in" in proc.stdout and "wc: '-l' -> '--lines'" in proc.stdout
    proc = localrl("agent", "tiny-shell", "x", "--workdir", str(tmp_path), "--follow-edits", str(tmp_path / "none"))
    assert proc.returncode != 0 and "no recorded sessions" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_each_way_of_learning_from_the_sessions_runs(tmp_path):
    """``bench approvals --learn``: one tiny step of GRPO against the learned person (shell_person) and of sft on the
    expert in the person's form, each a run the agent session opens; the harness revises as the edits would."""
    from localrl.benchmarks.approvals import LEARNERS
    from localrl.runs import Run

    sessions = record_sessions(tmp_path, "long-options", n=12)
    for learn in ("rl", "sft"):
        agent, revise = LEARNERS[learn]("tiny-shell", sessions, tmp_path / learn, 1, 0, print_fn=lambda *_: None,
                                        prompts_per_step=1, group_size=2)
        assert revise is None and Run(agent).read_config().env == "shell_person"
        [record] = [json.loads(line) for line in (tmp_path / learn / "run" / "metrics.jsonl").read_text().splitlines()
                    if json.loads(line).get("kind") == "train"]
        assert record["person_rules"] >= 1  # the run's steps carry how many rules the person was learned as
    agent, revise = LEARNERS["harness"]("tiny-shell", sessions, tmp_path / "harness", 1, 0, print_fn=lambda *_: None)
    assert agent == "tiny-shell" and revise("cat a | wc -l") == "cat a | wc --lines"
