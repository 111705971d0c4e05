"""The completion-budget curriculum (budget_schedule): each step's budget against hand-computed values, and a
scheduled run whose rollouts never pass the step's budget."""

from __future__ import annotations

import pytest

from localrl.config import TrainConfig
from localrl.errors import UserError
from localrl.training.length_schedule import max_tokens_at
from tests.helpers import QUIET, small, train_records


def budgets(**kw) -> list[int]:
    cfg = TrainConfig(**kw).validate()
    return [max_tokens_at(cfg, step) for step in range(cfg.steps)]


def test_constant_linear_and_step_budgets_are_the_hand_computed_ones():
    assert budgets(steps=4, max_new_tokens=64) == [64] * 4
    assert budgets(steps=4, max_new_tokens=64, max_new_tokens_final=16, budget_schedule="constant") == [64] * 4
    # linear: 64 + (16 - 64) * s / 4 for s = 0..4
    assert budgets(steps=5, max_new_tokens=64, max_new_tokens_final=16, budget_schedule="linear") == [64, 52, 40, 28, 16]
    # 10 steps, 40 -> 30: 40, 38.89, 37.78, ... rounded
    assert budgets(steps=10, max_new_tokens=40, max_new_tokens_final=30, budget_schedule="linear") == \
        [40, 39, 38, 37, 36, 34, 33, 32, 31, 30]
    # step: 3 stages of 6 steps each at 60, 40, 20; 7 steps in 2 stages: 4 at 60 (steps 0-3), then 20
    assert budgets(steps=18, max_new_tokens=60, max_new_tokens_final=20, budget_schedule="step", budget_stages=3) == \
        [60] * 6 + [40] * 6 + [20] * 6
    assert budgets(steps=7, max_new_tokens=60, max_new_tokens_final=20, budget_schedule="step") == [60] * 4 + [20] * 3
    assert budgets(steps=1, max_new_tokens=60, max_new_tokens_final=20, budget_schedule="linear") == [60]


@pytest.mark.parametrize("kw, message", [
    (dict(budget_schedule="cosine"), "config field budget_schedule: must be constant, linear or step"),
    (dict(max_new_tokens=32, max_new_tokens_final=48), "config field max_new_tokens_final: must be between 1 and"),
    (dict(max_new_tokens=32, max_new_tokens_final=8, overlong_cache=16), "must be at least overlong_cache (16)"),
    (dict(budget_stages=1), "config field budget_stages: must be at least 2"),
])
def test_bad_schedules_are_one_line(kw, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**kw).validate()


@pytest.mark.slow
def test_a_scheduled_run_samples_within_each_steps_budget(builtin_model, tmp_path):
    from localrl.training.loop import train

    cfg = small(tmp_path / "run", steps=4, max_new_tokens=40, max_new_tokens_final=10, budget_schedule="linear",
                rollout="torch")
    train(cfg, **QUIET)
    records = train_records(tmp_path / "run")
    assert [r["max_new_tokens"] for r in records] == [40, 30, 20, 10]
    assert all(r["completion_len"] <= r["max_new_tokens"] for r in records)
    assert records[-1]["truncated"] > 0  # the built-in model's answers need about 30 tokens: 10 cuts them


def test_the_length_reward_is_kimis_within_each_group():
    from localrl.data.rewards import default_rewards, length_penalty, numeric_match

    fn = length_penalty(numeric_match)
    completions = ["<answer>5</answer>", "<answer>4</answer>", "<answer>5</answer>",  # prompt A: 10, 20, 30 tokens
                   "<answer>4</answer>", "<answer>3</answer>"]  # prompt B: both 7 tokens
    ids = [[0] * 10, [0] * 20, [0] * 30, [0] * 7, [0] * 7]
    got = fn(completions, completion_ids=ids, prompt=["A", "A", "A", "B", "B"], answer=["5", "5", "5", "4", "4"])
    # A: lambda = 0.5 - (n - 10) / 20 = 0.5, 0, -0.5; the wrong middle one min(0, 0); B: all as long -> 0
    assert got == [0.5, 0.0, -0.5, 0.0, 0.0]
    fns, weights = default_rewards("numeric", 0.1, length_weight=0.3)
    assert [f.__name__ for f in fns] == ["numeric_match", "format_reward", "length"] and weights == [1.0, 0.1, 0.3]


@pytest.mark.slow
def test_the_curriculum_ends_with_shorter_completions_at_no_more_than_5_points_lower_accuracy(tmp_path):
    """tiny-arith-verbose ends half its pretraining traces with a redundant line; greedy, it always writes one.
    A budget shrinking from 64 to 32 tokens teaches it to drop the line: its held-out completions end shorter
    than the constant-budget run's at no more than 5 points lower accuracy. 12 steps, under a third of the default,
    to save CI time: 30.4 against 31.8 tokens here (20 steps: the same; 40 steps: 30.4 against 32.5; 30.4 against
    30.9 on an AMX machine)."""
    from localrl.config import TrainConfig
    from localrl.training.loop import train

    runs = {}
    for name, extra in (("constant", {}), ("linear", {"budget_schedule": "linear", "max_new_tokens_final": 32})):
        cfg = TrainConfig(model="tiny-arith-verbose", steps=12, eval_size=100, run_dir=str(tmp_path / name), **extra)
        runs[name] = train(cfg, log=lambda *_: None)
    constant, linear = runs["constant"].eval_after, runs["linear"].eval_after
    # measured (100 problems): 36.2 before; 31.8 constant against 30.4 linear, accuracy 100% and 100% (99% after 20
    # steps); on an AMX machine, whose llama.cpp rollouts run other kernels (quant/runtime.py), the constant run
    # dropped the line more often too (40 steps: 30.9 against 30.4)
    assert runs["constant"].eval_before["completion_len"] > constant["completion_len"] > linear["completion_len"]
    assert linear["accuracy"] >= constant["accuracy"] - 0.05 and constant["accuracy"] > 0.9
