"""The draft-refinement task (data = drafts): each level's mistake, the held-out split, and the draft_edits
reward against values worked by hand."""

from __future__ import annotations

import random

import pytest

from localrl.data import load_task
from localrl.data.arithmetic import Problem, is_held_out, parse_question
from localrl.data.drafts import DraftProblem, draft_lines, held_out_problems, render, sample_problems, working
from localrl.data.rewards import draft_edits


def test_each_level_carries_its_one_mistake_and_the_rest_follows():
    for d in sample_problems(random.Random(0), 300):
        truth_lines, truth = working(d.problem)
        lines = draft_lines(d.draft)
        given = d.draft.split("<answer>")[1].split("</answer>")[0]
        assert given != truth and d.question.startswith(d.problem.question + "\n")
        if d.level == 1:  # the working is right, one digit of the answer is not
            assert lines == truth_lines and len(given) == len(truth)
            assert sum(a != b for a, b in zip(given, truth)) == 1
        else:  # the lines before the mistake are right, its line is wrong, and the answer follows from the lines
            first = next(i for i, (a, b) in enumerate(zip(lines, truth_lines)) if a != b)
            column_sums = [int(line.rsplit("=", 1)[1]) for line in lines]
            carry_in = [line.count("+") == 2 for line in lines]
            if d.level == 2:
                assert abs(column_sums[first] - int(truth_lines[first].rsplit("=", 1)[1])) == 1
            else:  # the carry into the first wrong column is dropped
                assert lines[first].count("+") == 1 and truth_lines[first].count("+") == 2
            digits = "".join(str(s % 10) for s in reversed(column_sums))
            assert given == ((("1" if column_sums[-1] >= 10 else "") + digits).lstrip("0") or "0")
            assert all(c == (prev >= 10) for c, prev in zip(carry_in[first + 1:], column_sums[first:]))
    assert {d.level for d in sample_problems(random.Random(1), 60)} == {1, 2, 3}


def test_the_held_out_drafts_are_fixed_and_never_trained_on():
    held = held_out_problems(30)
    assert held == held_out_problems(30) and len(set(held)) == 30
    assert [d.level for d in held[:6]] == [1, 2, 3, 1, 2, 3]
    assert all(is_held_out(d.problem) for d in held)
    assert not any(is_held_out(d.problem) for d in sample_problems(random.Random(2), 200))
    task = load_task("drafts", eval_size=9)
    row = task.held_out[0]
    assert set(row) == {"prompt", "answer", "draft", "level"} and row["answer"] == held[0].answer
    assert task.sample(3, 4, seed=1) == task.sample(3, 4, seed=1)


def test_draft_edits_takes_off_the_share_of_right_lines_changed_from_right_answers():
    d = DraftProblem(Problem(457, 68), 2)
    prompt = d.question
    truth_lines, truth = working(d.problem)
    assert parse_question(prompt) == d.problem
    given = draft_lines(d.draft)
    right = [i for i, (a, b) in enumerate(zip(given, truth_lines)) if a == b]
    assert len(right) == 2  # one of the three columns is off by one, its two others right (457 + 68: 15, 12, 5)
    fixed = render(truth_lines, truth)
    one_right_line_changed = render([("9+9=18" if i == right[0] else line) for i, line in enumerate(truth_lines)],
                                    truth)
    short = "<think>7+8=15\n</think><answer>525</answer>"
    wrong_and_rewritten = render(["1+1=2"] * 3, "999")
    copied_unanswered = d.draft.split("</think>")[0]  # the right lines kept and no answer: the hack it once paid
    completions = [fixed, one_right_line_changed, short, "525", d.draft, wrong_and_rewritten, copied_unanswered]
    scores = draft_edits(completions, [prompt] * 7, [d.draft] * 7, ["525"] * 7)
    kept_in_short = int(right[0] == 0)
    # right answers pay for the right lines they changed; wrong ones (the draft's own too) pay nothing
    assert scores == pytest.approx([0.0, -0.5, -(2 - kept_in_short) / 2, -1.0, 0.0, 0.0, 0.0])
    # a chat-message prompt, and a question it cannot read (no penalty)
    assert draft_edits([short], [[{"role": "user", "content": prompt}]], [d.draft], ["525"]) == scores[2:3]
    assert draft_edits([short], ["no question here"], [d.draft], ["525"]) == [0.0]


def test_shell_drafts_pay_a_right_end_state_less_for_each_right_part_of_the_draft_it_changed(tmp_path):
    """env shell_drafts: the built-in task with its careless commands as the draft. The expert's fix keeps the
    draft's right words (reward 1); the draft as it is fails; a right rewrite (cat | wc -l for wc -w <) pays for
    the one right word it dropped ('<': 1 - 0.5 x 1/3); a wrong end state pays nothing for edits."""
    from localrl.config import TrainConfig
    from localrl.envs import environment_for
    from localrl.envs.shell import expert_answer, expert_call
    from localrl.envs.shell_drafts import HEADER, changed_share, with_draft
    from localrl.envs.shell_tasks import generate
    from localrl.errors import UserError
    from localrl.training.settings import check_config

    task = with_draft(generate(3, "count", 1))
    f = task.slip[0].split()[-1]
    assert task.slip == (f"wc -w < {f}",) and task.solution == (f"wc -l < {f}",)
    assert f"\n{HEADER} wc -w < {f}\n" in task.instruction
    assert changed_share(task, [f"cat {f} | wc -l"]) == pytest.approx(1 / 3)

    setup = environment_for(TrainConfig(env="shell_drafts", eval_size=6))
    assert all(HEADER in t.instruction for t in setup.held_out) and HEADER in setup.train(0).instruction
    env = setup.make_env(lambda seed: task)

    def play(*commands: str, answer: str | None = None) -> float:
        env.reset(0)
        observation = ""
        for command in commands:
            observation, _ = env.step(expert_call(command))
        env.step(f"<answer>{answer}</answer>" if answer is not None else expert_answer(observation, task))
        return env.reward()

    assert play(f"wc -l < {f}") == 1.0
    assert play(f"wc -w < {f}") == 0.0
    assert play(f"cat {f} | wc -l") == pytest.approx(1 - 0.5 / 3)
    assert play("ls", answer="0") == 0.0  # wrong, and every right word changed: no edit penalty on top
    env.close()
    with pytest.raises(UserError, match="^config field env_tasks: needs env shell"):  # a file has no drafts
        check_config(TrainConfig(env="shell_drafts", env_tasks=str(tmp_path / "t.jsonl")))
