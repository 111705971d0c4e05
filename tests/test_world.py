"""The simulated shell (``--env world:SOURCE``): its format, the real sandbox as the reference world model, the built-in
world model, a world model served by ``localrl serve``, and what a bad source or reply does."""

import random

import pytest

from localrl.envs import environment_for
from localrl.envs.shell import ShellEnv, expert_call, solve, task_list
from localrl.envs.shell_tasks import held_out_tasks, sample_tasks
from localrl.envs.tree import remove_tree
from localrl.envs.world import NO_REPLY, WorldEnv, probe
from localrl.envs.world_format import WorldReplyError, answer, apply, parse_answer, question, read_tree, write_tree
from localrl.envs.world_models import SandboxWorld, TorchWorld
from localrl.errors import UserError
from localrl.evaluation.world_fidelity import fidelity
from localrl.training.loop import train
from tests.helpers import QUIET, free_port, serving, small, train_records


class Scripted:
    """A world model that answers every question with ``reply(tree, command)`` (a stand-in for a model's words, to
    test what the environment does with them)."""

    name = "scripted"

    def __init__(self, reply):
        self.reply = reply

    def ask(self, tree, command):
        return self.reply(tree, command)

    def close(self):
        pass


NOTHING_HAPPENS = Scripted(lambda tree, command: "<output>\n\n[exit code 0]\n</output>\n")


def test_a_step_round_trips_through_the_format(tmp_path):
    before = {"a.txt": "one\ntwo\n", "raw": "no newline", "logs/x.log": "1\n", "logs/y.log": "2\n", "old/": "",
              "keep/b.txt": ""}
    after = {"a.txt": "one\ntwo\nthree\n", "raw": "no newline", "logs/x.log": "1\n", "new/": "", "keep/b.txt": "",
             "moved": "still no newline"}
    reply = answer("3 a.txt\n[exit code 0]", before, after)
    observation, written, removed = parse_answer(reply)
    assert observation == "3 a.txt\n[exit code 0]"
    assert apply(before, written, removed) == after
    assert set(removed) == {"logs/y.log", "old/"} and set(written) == {"a.txt", "new/", "moved"}
    assert "== moved [no final newline]\nstill no newline\n" in reply
    assert parse_answer(answer("\n[exit code 0]", before, before)) == ("\n[exit code 0]", {}, [])
    write_tree(after, tmp_path)
    assert read_tree(tmp_path) == after
    assert question({}, "ls") == "Files: (none)\nCommand: ls"
    # a directory emptied by a removal keeps its place; a file written into an empty directory fills it
    assert apply({"d/x": "1\n"}, {}, ["d/x"]) == {"d/": ""}
    assert apply({"d/": ""}, {"d/x": "1\n"}, []) == {"d/x": "1\n"}
    assert apply({"d/x": "1\n", "d/y": "2\n", "e": ""}, {}, ["d"]) == {"e": ""}


@pytest.mark.parametrize("reply, why", [
    ("the file has 3 lines", "does not start with <output>"),
    ("<output>\n3\n", "its <output> is not closed"),
    ("<output>\n3\n</output>\nsome words\n", "a line outside any file"),
    ("<output>\n</output>\n== ../../etc/passwd\nx\n", "a path outside the working directory"),
    ("<output>\n</output>\n-- /etc\n", "a path outside the working directory"),
    ("<output>\n</output>\n== \nx\n", "an empty path"),
])
def test_a_reply_out_of_the_format_or_leaving_the_directory_is_not_read(reply, why):
    with pytest.raises(WorldReplyError, match=why):
        parse_answer(reply)


@pytest.mark.slow
def test_the_sandbox_as_world_model_plays_every_episode_as_the_real_shell_does():
    """The reference: the real shell answering in the world format gives each command's output and each episode's
    reward exactly as the shell environment does, expert and careless solutions alike."""
    tasks = sample_tasks(random.Random(5), 20)
    source, world = task_list(tasks), SandboxWorld()
    real, sim = ShellEnv(source, max_turns=8), WorldEnv(world, source, max_turns=8)
    rewards = []
    for i in range(len(tasks)):
        for slip in (False, True):
            real_reward, real_turns = solve(real, i, slip)
            sim_reward, sim_turns = solve(sim, i, slip)
            assert (sim_reward, sim_turns) == (real_reward, real_turns), tasks[i].instruction
            assert sim.tree == read_tree(real.workdir)
            rewards.append(real_reward)
    real.close()
    assert 0 < sum(r == 1.0 for r in rewards) < len(rewards)  # the careless solutions fail some


@pytest.mark.slow
def test_fidelity_is_total_for_the_sandbox_and_low_for_a_world_where_nothing_happens():
    tasks = held_out_tasks(15)
    perfect = fidelity(SandboxWorld(), tasks)
    assert all(perfect["all"][k] == 1.0 for k in ("output", "files", "final_files", "reward"))
    assert perfect["all"]["overrated"] == perfect["all"]["underrated"] == 0.0
    assert perfect["all"]["episodes"] == 30 and set(perfect) == {"count", "csv", "edit", "files", "multi", "all"}
    idle = fidelity(NOTHING_HAPPENS, tasks)
    assert idle["count"]["output"] == 0.0  # every count prints a number
    assert idle["edit"]["final_files"] <= 0.5  # every expert edit changes a file (a careless sed without -i not)
    assert 0.0 < idle["all"]["reward"] < 1.0  # a wrong answer and no change agree with some careless episodes
    assert idle["all"]["overrated"] == 0.0 < idle["all"]["underrated"]  # nothing done never scores above the truth


def test_an_unreadable_reply_is_counted_and_shown_once_and_the_episode_goes_on(capsys):
    task = next(t for t in sample_tasks(random.Random(1), 50) if t.family == "count")
    garbled = Scripted(lambda tree, command: "I think it prints 12")
    env = WorldEnv(garbled, task_list([task]), max_turns=4)
    for _ in range(2):
        env.reset(0)
        assert env.step(expert_call(task.solution[0])) == (NO_REPLY, False)
        assert env.step(expert_call("ls")) == (NO_REPLY, False)
        env.step("<answer>12</answer>")
        assert env.stats.counts == {"world_unparsed": 2, "world_failed": 0}
        assert env.tree == apply({}, dict(task.files), [])  # nothing changed
        env.reward()
    err = capsys.readouterr().err
    assert err.count("localrl: warning: world model scripted: a reply not in the world format: it does not start "
                     "with <output>") == 1 and "I think it prints 12" in err
    silent = WorldEnv(Scripted(lambda tree, command: None), task_list([task]))
    silent.reset(0)
    silent.step(expert_call("ls"))
    assert silent.stats.counts == {"world_unparsed": 0, "world_failed": 1}
    with pytest.raises(UserError, match=r"^config field env: world model scripted: its reply to a first question "
                                        r"\('grep .*'\) is not in the world format: it does not start with <output> "
                                        r"\(reply 'I think it prints 12'\)$"):
        probe(garbled, task)


def test_bad_world_sources_are_one_line_before_anything_runs(tmp_path):
    closed = f"http://127.0.0.1:{free_port()}/v1"
    cases = [("world", r"^config field env: environment 'world' needs its SOURCE: world:SOURCE$"),
             ("world:", r"^config field env: environment 'world' needs its SOURCE: world:SOURCE$"),
             (f"world:{tmp_path / 'nowhere'}", r"^config field env: world model \S+nowhere: no such directory, and "
                                              r"not a built-in model"),  # (it said model '...': the policy's field)
             (f"world:{closed}", r"^config field env: the world model at http://127\.0\.0\.1:\d+/v1 does not answer")]
    for i, (env, message) in enumerate(cases):
        with pytest.raises(UserError, match=message):
            train(small(tmp_path / f"run{i}", env=env, steps=1, judge_retries=0), **QUIET)
        assert not (tmp_path / f"run{i}").exists()


@pytest.fixture(scope="module")
def world_model():
    world = TorchWorld("tiny-shell-world")
    yield world
    world.close()


def test_the_built_in_world_model_answers_in_the_format(world_model):
    tasks = held_out_tasks(10)
    result = fidelity(world_model, tasks)
    assert result["all"]["commands"] > 0 and result["all"]["output"] > 0.5, result


def test_training_in_the_simulation_evaluates_in_the_real_sandbox(tmp_path):
    cfg = small(tmp_path / "run", env="world:tiny-shell-world", steps=1, prompts_per_step=2, group_size=4,
                eval_size=5, max_new_tokens=48)
    assert isinstance(environment_for(cfg).eval_env(task_list(held_out_tasks(1))), ShellEnv)
    result = train(cfg, **QUIET)
    [record] = train_records(result.run_dir)
    assert record["world"] == "tiny-shell-world" and record["held_out_in"] == "sandbox"
    assert record["world_failed"] == 0 and "world_unparsed" in record
    assert result.eval_before is not None and result.eval_after is not None


@pytest.fixture(scope="module")
def served_world(tmp_path_factory):
    from localrl.models import builtin_path
    from localrl.quant.export import export

    gguf = tmp_path_factory.mktemp("world-gguf") / "tiny-shell-world.gguf"
    export(builtin_path("tiny-shell-world"), gguf, "f16", check=False, log=lambda *_: None)
    for base, _ in serving(gguf, tmp_path_factory.mktemp("serve")):
        yield base


@pytest.mark.slow
def test_a_world_model_served_by_localrl_serve_is_the_environment(served_world, world_model, tmp_path):
    """The built-in world model exported to GGUF and served over the OpenAI-compatible API answers as it does in
    torch, and a run trains in it."""
    from localrl.envs.world_models import EndpointWorld
    from localrl.generation.endpoint import EndpointSettings

    tasks = held_out_tasks(10)
    served = fidelity(EndpointWorld(served_world, EndpointSettings()), tasks)
    assert served["all"]["output"] > 0.5 and abs(served["all"]["reward"] - fidelity(world_model, tasks)["all"]["reward"]) <= 0.1
    result = train(small(tmp_path / "run", env=f"world:{served_world}", steps=1, prompts_per_step=2, group_size=4,
                         eval_size=0), **QUIET)
    [record] = train_records(result.run_dir)
    assert record["world"] == served_world and record["world_failed"] == 0


@pytest.mark.slow
def test_a_served_model_that_is_no_world_model_is_one_line(tmp_path_factory, tmp_path):
    """The built-in agent, served (with room for the question and a whole reply), answers a world question with its
    own kind of text: the run stops before anything is written, naming the format."""
    from localrl.models import builtin_path
    from localrl.quant.export import export

    gguf = tmp_path_factory.mktemp("agent-gguf") / "tiny-shell.gguf"
    export(builtin_path("tiny-shell"), gguf, "f16", check=False, log=lambda *_: None)
    for base, _ in serving(gguf, tmp_path_factory.mktemp("serve"), "--n-ctx", "1024"):
        with pytest.raises(UserError, match=r"^config field env: world model http.*: its reply to a first question "
                                            r"\(.*\) is not in the world format"):
            train(small(tmp_path / "run", env=f"world:{base}", steps=1), **QUIET)
        assert not (tmp_path / "run").exists()


def test_a_real_tree_is_read_at_any_depth_and_through_no_link(tmp_path):
    """What the sandbox world reads after a command is the command's: a tree deeper than Python's recursion limit
    (read with os.walk, a RecursionError) and a link to a host file (read with the trainer's rights) included."""
    import os
    import subprocess

    secret = tmp_path / "host-secret"
    secret.write_text("hunter2\n")
    root = tmp_path / "work"
    root.mkdir()
    subprocess.run(["bash", "-c", "mkdir -p $(printf 'a/%.0s' $(seq 1100)) && echo deep > $(printf 'a/%.0s' "
                    "$(seq 1100))f && mkdir empty"], cwd=root, check=True)
    os.symlink(secret, root / "guess")
    os.mkfifo(root / "fifo")
    try:
        tree = read_tree(root)
    finally:  # pytest's own clean-up of its temporary directories recurses, and would fail on this tree
        assert remove_tree(root)
    assert tree == {"a/" * 1100 + "f": "deep\n", "empty/": ""}


def test_a_world_model_endpoint_that_fails_every_request_stops_the_run_in_one_line(tmp_path, capsys):
    """Its first answer passes the start's probe; every request after it fails (HTTP 500): the run stops after the
    stated number in a row, naming the world model and its last error (before, each was a counted NO_REPLY)."""
    from localrl.generation.endpoint import FAILURES_IN_A_ROW
    from tests.helpers import ScriptedJudge, run_cli

    with ScriptedJudge(lambda messages: answer("", {}, {}), fail=[200] + [500] * 10_000) as world:
        code, err = run_cli(capsys, "train", "--env", f"world:{world.url}|{ScriptedJudge.MODEL}", "--judge-retries",
                            "0", "--steps", "5", "--prompts-per-step", "2", "--group-size", "2", "--eval-size", "0",
                            "--run-dir", tmp_path / "run")
    # the first failure's warning (said once a run), then the stop
    assert code == 2 and len(err) == 2 and err[0].startswith("localrl: warning: world model http"), err
    assert err[1].startswith("localrl: error: config field env: the world model at http://127.0.0.1:") and \
        f"failed {FAILURES_IN_A_ROW} requests in a row, each after 0 retries (the last: " in err[1], err
