"""The scripted person of the approvals experiment (``localrl bench approvals``): its rule (options spelt long) against
hand-written edits, the edit keeping what every built-in task's commands do in the real sandbox, and the experiment
at a tiny size."""

from __future__ import annotations

import json
import random

import pytest

from localrl.agent.scripted_person import RULES, ScriptedPerson, long_options, under_timeout
from localrl.envs.shell_tasks import FAMILIES, LEVELS, generate


@pytest.mark.parametrize("command, edited", [
    ("wc -l < notes.txt", "wc --lines < notes.txt"),
    ("grep -c ERROR app.log", "grep --count ERROR app.log"),
    ("tail -n +2 d.csv | wc -l", "tail --lines=+2 d.csv | wc --lines"),
    ("cut -d, -f2 d.csv | sort -u > names.txt", "cut --delimiter=, --fields=2 d.csv | sort --unique > names.txt"),
    ("cut -d ',' -f 2 d.csv", "cut --delimiter=',' --fields=2 d.csv"),
    ("sed -i 's/a b/c/g' f.txt", "sed --in-place 's/a b/c/g' f.txt"),
    ("sed -i.bak s/a/b/ f", "sed --in-place=.bak s/a/b/ f"),
    ("rm -rf build && mkdir -p a/b", "rm --recursive --force build && mkdir --parents a/b"),
    ("sort -t, -k2 -n f", "sort --field-separator=, --key=2 --numeric-sort f"),
    ("X=1 /usr/bin/wc -w f 2> /dev/null", "X=1 /usr/bin/wc --words f 2> /dev/null"),
    # left as they are: no short option with a long spelling, a letter without one, after --, a file after a
    # redirection, a tool not in the table, a quoted option
    ("echo -n hi > f.txt", "echo -n hi > f.txt"),
    ("ls -la", "ls -la"),
    ("head -5 f", "head -5 f"),
    ("grep -- -c f", "grep -- -c f"),
    ("cat < -n", "cat < -n"),
    ("find . -type f -name '*.md' | wc -l", "find . -type f -name '*.md' | wc --lines"),
    ("grep '-c' f", "grep '-c' f"),
    ("mv a.txt b.txt", "mv a.txt b.txt"),
])
def test_long_options_against_hand_written_edits(command, edited):
    assert long_options(command) == edited
    assert long_options(edited) == edited  # the allowed form is allowed


def test_under_timeout():
    assert under_timeout("tail -n +2 a.csv | wc -l") == "timeout 10 tail -n +2 a.csv | wc -l"
    assert under_timeout("timeout 5 sleep 1") == "timeout 5 sleep 1"
    assert under_timeout(" ls ") == "timeout 10 ls"


def test_the_person_approves_the_allowed_form_and_edits_the_rest():
    person = ScriptedPerson(long_options)
    assert person.ask("mv a b", "not yet allowed here") == ("run", "mv a b")
    assert person.ask("wc -l < a", "not yet allowed here") == ("run", "wc --lines < a")
    assert (person.asked, person.approved, person.approval_rate) == (2, 1, 0.5)
    person = ScriptedPerson()  # the default rule: a time limit
    assert person.ask("timeout 10 ls", "") == ("run", "timeout 10 ls") and person.ask("ls", "")[1] == "timeout 10 ls"


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES)
def test_the_edit_keeps_what_every_built_in_tasks_commands_do(tmp_path, rule):
    """Every family and level, the expert's commands and the careless slip: run as written and as the person edits
    them, in the real sandbox, they score the same (the expert's 1.0)."""
    from localrl.envs.sandbox import Sandbox
    from localrl.envs.shell import expert_answer

    def play(task, commands, form, workdir) -> float:
        workdir.mkdir()
        task.setup(workdir)
        sandbox = Sandbox(workdir, timeout=10)
        outputs = [sandbox.run(form(c)).describe(echo=False) for c in commands]
        return task.score(workdir, expert_answer(outputs[-1], task))

    edited = 0
    for family in FAMILIES:
        for level in LEVELS:
            task = generate(random.Random(f"{family}{level}").randrange(2**32), family, level)
            for who, commands in (("expert", task.solution), ("slip", task.slip)):
                written = play(task, commands, str, tmp_path / f"{family}{level}-{who}")
                assert play(task, commands, RULES[rule], tmp_path / f"{family}{level}-{who}-edited") == written, \
                    (family, level, commands)
                assert who == "slip" or written == 1.0
                edited += any(RULES[rule](c) != c for c in commands)
    assert edited >= 12  # the rule is about most of the built-in commands


@pytest.mark.slow
def test_bench_approvals_tiny(tmp_path):
    """The whole experiment at a tiny size, as a user runs it: sessions recorded (the edits among them), DPO trained on
    them, the agent measured before and after on held-out tasks."""
    from tests.test_bench import bench, json_line

    proc = bench("approvals", "--rule", "long-options", "--sessions", "12", "--held-out", "6", "--steps", "2", "--out", str(tmp_path / "out"),
                 "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json_line(proc.stdout)
    records = [json.loads(line) for line in (tmp_path / "out" / "sessions" / "sessions.jsonl").read_text().splitlines()]
    assert len(records) == 12 and {t["decision"] for r in records for t in r["turns"]} == {"approved", "edited"}
    for when in ("before", "after"):
        assert result[when]["tasks"] == 6 and result[when]["proposals"] >= 6
        assert 0 <= result[when]["approval_rate"] <= 1 and 0 <= result[when]["success"] <= 1
    assert "first proposals approved:" in proc.stdout
    assert (tmp_path / "out" / "run" / "config.toml").is_file()
