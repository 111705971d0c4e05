"""The shell environment: generated tasks, their verifiers, the episode protocol and users' tasks,
all run for real in the sandbox."""

import gc
import json
import os
import random
import re
import time

import pytest

from localrl.envs.sandbox import LEVELS as LEVELS_SANDBOX, level_works
from localrl.envs.shell import WORKDIR_PREFIX, ShellEnv, expert_call, generated_tasks, solve, task_list
from localrl.envs.shell_tasks import FAMILIES, LEVELS, Check, ShellTask, generate, held_out_tasks, sample_tasks
from localrl.envs.task_files import load_tasks
from localrl.envs.task_names import COMMON_NAMES, EXAMPLE_NAMES, Names, name_side, rename
from localrl.errors import UserError

CELLS = [(f, lv) for f in FAMILIES for lv in LEVELS]


@pytest.mark.slow
@pytest.mark.parametrize("family,level", CELLS)
def test_every_expert_solution_scores_one_and_doing_nothing_does_not(family, level):
    tasks = [generate(seed, family, level) for seed in range(6)]
    env = ShellEnv(task_list(tasks))
    try:
        for seed, task in enumerate(tasks):
            reward, turns = solve(env, seed)
            assert reward == 1.0, (task.instruction, turns)
            env.reset(seed)
            env.step("<answer>I did nothing</answer>")
            assert env.reward() < 1.0, task.instruction
    finally:
        env.close()


@pytest.mark.slow
def test_slips_are_plausible_and_mostly_wrong():
    tasks = [generate(seed, family, level) for seed in range(6) for family, level in CELLS]
    env = ShellEnv(task_list(tasks))
    rewards = [solve(env, i, slip=True)[0] for i in range(len(tasks))]
    env.close()
    assert all(task.slip for task in tasks)
    assert sum(r == 1.0 for r in rewards) / len(rewards) < 0.3
    for cell in CELLS:  # every kind of task has a slip that fails
        assert min(r for r, t in zip(rewards, tasks) if (t.family, t.level) == cell) < 1.0, cell


def test_destroying_everything_does_not_earn_a_deletion():
    task = next(t for t in (generate(s, "files", 2) for s in range(100)) if t.instruction.startswith("Delete")
                and len(t.files) > 1)
    env = ShellEnv(task_list([task]))
    env.reset(0)
    env.step(expert_call("rm -f *"))
    env.step("done")
    assert 0.0 < env.reward() < 1.0
    env.close()


def test_partial_credit_is_the_fraction_of_conditions_met(tmp_path):
    check = Check(files={"a": "1", "b": "2"}, absent=("c",), dirs=("d",))
    (tmp_path / "a").write_text("1\n")
    (tmp_path / "b").write_text("wrong")
    (tmp_path / "c").write_text("")
    assert check.score(tmp_path, "") == 0.25
    assert Check(answer="12").score(tmp_path, "<answer>12</answer>") == 1.0
    assert Check(answer="12").score(tmp_path, "<answer>13</answer>") == 0.0
    assert Check(answer="paris").score(tmp_path, "<answer>Paris.</answer>") == 1.0


def test_episodes_are_reproducible_from_the_seed_and_leave_nothing_behind():
    env = ShellEnv()
    first = env.reset(123)
    files = sorted(p.relative_to(env.workdir).as_posix() for p in env.workdir.rglob("*"))
    workdir = env.workdir
    assert env.reset(123) == first and not workdir.exists()
    assert sorted(p.relative_to(env.workdir).as_posix() for p in env.workdir.rglob("*")) == files
    assert env.reset(124) != first or env.task.files != generated_tasks()(123).files
    last = env.workdir
    env.close()
    assert not last.exists()


def test_turns_tool_calls_invalid_calls_and_the_turn_limit():
    env = ShellEnv(max_turns=3)
    env.reset(5)
    observation, done = env.step(expert_call("echo hello"))
    assert "hello" in observation and "[exit code 0]" in observation and not done
    observation, done = env.step('<tool_call>{"name": "shell", "arguments": {}}</tool_call>')
    assert "not a valid tool call" in observation and not done
    observation, done = env.step(expert_call("ls"))
    assert done  # the third turn was the last
    assert (env.stats.turns, env.stats.tool_calls, env.stats.invalid_calls, env.stats.answered) == (3, 2, 1, False)
    env.reset(5)
    assert env.step("<answer>4</answer>") == ("", True) and env.stats.answered
    env.close()


def test_the_held_out_split_is_disjoint_and_the_task_space_large():
    train = {t.key() for t in sample_tasks(random.Random(0), 3000)}
    held = {t.key() for t in held_out_tasks(150)}
    assert len(train) > 2500 and len(held) == 150 and not train & held
    assert [t.key() for t in held_out_tasks(30)] == [t.key() for t in held_out_tasks(30)]
    assert {(t.family, t.level) for t in held_out_tasks(15)} == set(CELLS)


def _words(task) -> set[str]:
    text = " ".join([task.instruction, *task.files, *task.solution]).replace("\\b", " ")  # sed's \b: no letter
    return set(re.findall(r"[a-z]+", text))


# the words of the tasks' wording and commands: what is left of tasks whose names are all placeholders
TEMPLATE_WORDS = set().union(*(_words(generate(s, names="placeholders")) for s in range(600))) - {"zq"}


def _names_of(task) -> set[str]:
    """The vocabulary words a task names: file stems (number suffixes off), directories, words it writes."""
    return _words(task) - TEMPLATE_WORDS


def test_names_come_from_a_large_vocabulary_and_held_out_tasks_name_only_unseen_ones():
    """The built-in agent once knew only its generator's 32 file names: `grep -c ERROR lemon.log` for app.log."""
    train = sample_tasks(random.Random(0), 2000)
    held = held_out_tasks(150)
    trained_names = set().union(*map(_names_of, train))
    held_names = set().union(*map(_names_of, held))
    assert len(trained_names) > 2000  # files, directories and words: read from the task, never recalled
    assert all(name_side(n) == "seen" for n in trained_names)
    assert all(name_side(n) == "unseen" for n in held_names) and not trained_names & held_names
    assert {name_side(n) for n in EXAMPLE_NAMES} == {"unseen"}  # the README's app.log is never trained on
    seen_held = held_out_tasks(30, names="seen")  # held out by content, named from the training side
    assert not {t.key() for t in seen_held} & {t.key() for t in train}
    assert all(name_side(n) == "seen" for t in seen_held for n in _names_of(t))


def test_placeholders_give_an_episode_fresh_names_consistently():
    task = generate(3, "multi", 1, names="placeholders")
    assert "zq0zq" in task.instruction
    texts = [task.instruction, *task.solution]
    a, b = rename(texts, Names(random.Random(0))), rename(texts, Names(random.Random(1)))
    assert a != b and not any("zq" in t for t in a + b)
    first = a[0].split()[1]  # "Copy NAME.log into ...": the same name in the instruction and every command
    assert first.endswith(".log") and first in a[2] and first in a[3]


def test_a_users_jsonl_tasks(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [{"instruction": "How many lines are in a.txt?", "files": {"a.txt": "x\ny\n"}, "check": {"answer": 2}},
            {"instruction": "Remove b.", "files": {"b": "1", "keep/c": "2"}, "check": {"absent": ["b"],
                                                                                   "files": {"keep/c": "2"}}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = load_tasks(str(path))
    env = ShellEnv(task_list(tasks))
    env.reset(0)
    env.step(expert_call("wc -l < a.txt"))
    env.step("<answer>2</answer>")
    assert env.reward() == 1.0
    env.reset(1)
    env.step(expert_call("rm b"))
    env.step("done")
    assert env.reward() == 1.0
    env.close()


@pytest.mark.parametrize("row,message", [
    ({"files": {}, "check": {"answer": 1}}, "instruction: must be a non-empty string"),
    ({"instruction": "x", "files": {"../up": "1"}, "check": {"answer": 1}}, "stay inside"),
    ({"instruction": "x", "files": {"/etc/passwd": "1"}, "check": {"answer": 1}}, "must be relative"),
    ({"instruction": "x", "check": {"absent": ["../../x"]}}, "stay inside"),
    ({"instruction": "x", "check": {"grep": "y"}}, "check: must be"),
    ({"instruction": "x", "check": {"answer": True}}, "answer"),
    ({"instruction": "x", "check": {"answer": 1}, "setup": "rm -rf /"}, "unknown field 'setup'"),
])
def test_bad_task_lines_are_one_line_naming_the_line(tmp_path, row, message):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n" + json.dumps(row) + "\n")
    with pytest.raises(UserError, match=message) as info:
        load_tasks(str(path))
    assert f"{path}:2" in str(info.value)


def test_tasks_from_a_python_callable(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(
        "from localrl.envs.shell_tasks import Check, ShellTask\n"
        "def tasks():\n"
        "    return [ShellTask('Say hi.', {}, lambda root, text: float('hi' in text))]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tasks = load_tasks("my_tasks:tasks")
    env = ShellEnv(task_list(tasks))
    env.reset(0)
    env.step("hi there")
    assert env.reward() == 1.0
    env.close()
    with pytest.raises(UserError, match="cannot import it"):
        load_tasks("my_tasks:missing")
    assert isinstance(tasks[0], ShellTask)


def test_a_curriculum_restricts_training_tasks_but_not_the_held_out_set():
    from localrl.envs import environment_for
    from localrl.training.settings import build_config

    setup = environment_for(build_config(None, {"env": "shell", "env_levels": "1", "env_families": "count,edit",
                                          "eval_size": 30}))
    drawn = [setup.train(seed) for seed in range(60)]
    assert {t.level for t in drawn} == {1} and {t.family for t in drawn} == {"count", "edit"}
    assert not any(t.is_held_out() for t in drawn)
    assert {t.level for t in setup.held_out} == {1, 2, 3} and len({t.family for t in setup.held_out}) == 5
    with pytest.raises(UserError, match="applies to the built-in shell tasks"):
        build_config(None, {"env_levels": "1"})



# -- the reward check reads the model's final tree: it must never reach the host nor block ---------------------

LEVELS_HERE = [pytest.param(level, marks=pytest.mark.skipif(not level_works(level), reason=f"no {level} here"))
               for level in LEVELS_SANDBOX]


def one_task_env(check, level=None) -> ShellEnv:
    return ShellEnv(task_list([ShellTask("Make the files.", {"start.txt": "x\n"}, check)]), isolation=level, timeout=5)


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_a_link_to_a_host_file_earns_nothing_and_special_files_do_not_block(tmp_path, level):
    secret = tmp_path / "host-secret"
    secret.write_text("hunter2\n")
    check = Check(files={"guess": "hunter2", "fifo": "x", "kmsg": "x", "inside": "x"})
    env = one_task_env(check, level)
    try:
        env.reset(0)
        env.step(expert_call(f"ln -s {secret} guess; mkfifo fifo; ln -s /proc/kmsg kmsg; echo x > real; "
                             "ln -s real inside"))
        env.step("<answer>done</answer>")
        t0 = time.monotonic()
        assert env.reward() == 0.0  # not even the link inside the tree: no link is followed
        assert time.monotonic() - t0 < 2
        assert Check(files={"real": "x"}).score(env.workdir, "") == 1.0  # the probe can succeed
    finally:
        env.close()


def test_a_hard_link_to_a_file_elsewhere_is_not_read(tmp_path):
    (tmp_path / "elsewhere").write_text("hunter2\n")
    (tmp_path / "work").mkdir()
    os.link(tmp_path / "elsewhere", tmp_path / "work" / "guess")
    assert Check(files={"guess": "hunter2"}).score(tmp_path / "work", "") == 0.0


def test_a_users_verifier_sees_no_link_out_and_no_fifo(tmp_path):
    secret = tmp_path / "host-secret"
    secret.write_text("hunter2\n")

    def verifier(root, text):  # a careless verifier: follows links, opens whatever is there
        leaked = (root / "guess").exists() and (root / "guess").read_text().strip() == "hunter2"
        blocked = (root / "fifo").exists() and (root / "fifo").read_text()
        return float(leaked or bool(blocked))

    env = one_task_env(verifier)
    try:
        env.reset(0)
        env.step(expert_call(f"ln -s {secret} guess; mkfifo fifo"))
        env.step("<answer>done</answer>")
        assert env.reward() == 0.0
    finally:
        env.close()


def test_a_users_verifier_sees_no_outward_link_and_scores_at_once(tmp_path):
    """The same attack without a FIFO: a blocked read cannot hide a leak behind the verifier's timeout (with the
    links left in place, this scored 1.0)."""
    secret = tmp_path / "host-secret"
    secret.write_text("hunter2\n")
    env = one_task_env(lambda root, text: float((root / "guess").exists() and
                                                (root / "guess").read_text().strip() == "hunter2"))
    try:
        env.reset(0)
        env.step(expert_call(f"ln -s {secret} guess; mkdir -p d/e; ln -s {secret} d/e/deep"))
        env.step("<answer>done</answer>")
        started = time.monotonic()
        assert env.reward() == 0.0 and time.monotonic() - started < 2
        assert not os.path.lexists(env.workdir / "guess") and not os.path.lexists(env.workdir / "d/e/deep")
    finally:
        env.close()


def test_a_users_verifier_that_hangs_scores_zero_and_one_that_returns_nan_stops(tmp_path, capsys):
    task = ShellTask("x", {}, lambda root, text: time.sleep(30))
    t0 = time.monotonic()
    assert task.score(tmp_path, "", timeout=0.5) == 0.0
    assert time.monotonic() - t0 < 2 and "ran past 0.5 s" in capsys.readouterr().err
    with pytest.raises(UserError, match="returned nan"):
        ShellTask("x", {}, lambda root, text: float("nan")).score(tmp_path, "")
    with pytest.raises(UserError, match="failed: ZeroDivisionError"):
        ShellTask("x", {}, lambda root, text: 1 / 0).score(tmp_path, "")


def test_episode_directories_are_removed_on_close_and_stale_ones_swept(tmp_path):
    stale = tmp_path / f"{WORKDIR_PREFIX}999999999-abc"  # a pid no process has
    stale.mkdir()
    (stale / "f").write_text("left by a killed run")
    live = tmp_path / f"{WORKDIR_PREFIX}{os.getpid()}-abc"
    live.mkdir()
    env = ShellEnv(root=tmp_path)
    assert not stale.exists() and live.exists()
    env.reset(0)
    workdir = env.workdir
    assert workdir.name.startswith(f"{WORKDIR_PREFIX}{os.getpid()}-")
    del env
    gc.collect()
    assert not workdir.exists()  # dropped without close(): the finalizer removes it
