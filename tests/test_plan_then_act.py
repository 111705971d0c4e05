"""PTA-GRPO's plan then act (``--sampler plan_then_act``): plan rewards and the composite reward by hand, the plan
cut at ``</plan>``, what the rewards score, a run, its exact resume, bad settings."""

from __future__ import annotations

import pytest
import torch

from localrl.errors import UserError
from localrl.models import builtin_path
from localrl.modeling import load_tokenizer
from localrl.policy.losses import group_advantages
from localrl.samplers.plan_then_act import after_plan, composite_rewards, cut_plan, plan_rewards
from localrl.training.loop import train
from localrl.training.settings import build_config
from tests.helpers import QUIET, small, train_records


def test_plan_rewards_by_hand():
    """Two plans of one prompt, three completions each: the first plan's completions right 2 of 3 times, the
    second's once. Plan rewards 2/3 and 1/3; each completion's reward adds its plan's (x plan_weight 0.5) to its
    outcome, so a wrong completion after the better plan outranks a wrong one after the worse."""
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    outcome = correct * 1.0 + 0.1  # (a format reward every completion met)
    assert plan_rewards(correct, 3).tolist() == pytest.approx([2 / 3, 1 / 3])
    rewards = composite_rewards(outcome, correct, 3, 0.5)
    assert rewards.tolist() == pytest.approx([1.1 + 1 / 3, 1.1 + 1 / 3, 0.1 + 1 / 3, 0.1 + 1 / 6, 1.1 + 1 / 6,
                                              0.1 + 1 / 6])
    advantages = group_advantages(rewards, 6, "none")  # GRPO's over all of the prompt's rows
    assert advantages[2] > advantages[3] and advantages[0] > advantages[4]
    assert advantages.sum().item() == pytest.approx(0.0, abs=1e-12)


def test_a_plan_ends_at_its_closing_tag_and_the_rewards_score_what_follows():
    tok = load_tokenizer(builtin_path("tiny-arith"))
    ids = tok("<plan>add the columns</plan><think>1+2=3\n", add_special_tokens=False)["input_ids"]
    plan, closed = cut_plan(tok, ids)
    assert closed and tok.decode(plan) == "<plan>add the columns</plan>"
    assert cut_plan(tok, ids[:10]) == (ids[:10], False)
    assert after_plan(" <plan>add</plan>\n<think>1+2=3\n</think><answer>3</answer>") == \
        "<think>1+2=3\n</think><answer>3</answer>"
    assert after_plan("<think>1+2=3\n</think><answer>3</answer>") == "<think>1+2=3\n</think><answer>3</answer>"


def _config(run_dir, **kw):
    return small(run_dir, **{"sampler": "plan_then_act", "prompts_per_step": 2, "group_size": 2, "plan_count": 3,
                             "plan_tokens": 8, "steps": 2, **kw})


def test_a_plan_then_act_run_trains_on_its_plans(tmp_path):
    """(Its resume: tests/test_resume_contract.py.)"""
    full = train(_config(tmp_path / "full"), **QUIET)
    records = train_records(full.run_dir)
    assert [r["step"] for r in records] == [1, 2] and all(r["completions"] == 2 * 3 * 2 for r in records)
    assert all(0 <= r["plan_reward_mean"] <= 1 and r["plans_closed"] == 0.0 for r in records)  # (never taught)
    assert any(r["plan_reward_spread"] > 0 for r in records)  # plans of a prompt did differ in how much they helped


@pytest.mark.parametrize("flags, message", [
    ({"sampler": "plan_then_act", "plan_count": 1}, "config field plan_count: must be from 2 to 16"),
    ({"sampler": "plan_then_act", "plan_tokens": 0}, "config field plan_tokens: must be from 1 to 1024"),
    ({"sampler": "plan_then_act", "plan_weight": -1}, "config field plan_weight: must be at least 0"),
    ({"plan_weight": 2.0}, "config field plan_weight: needs sampler plan_then_act"),
    ({"sampler": "plan_then_act", "objective": "experience"},
     r"config field objective: experience cannot train with sampler plan_then_act \(its advantages are GRPO's"),
    ({"sampler": "plan_then_act", "markovian_chunk": 16}, "config field sampler: plan_then_act samples prompt"),
])
def test_bad_plan_then_act_settings_are_one_line(flags, message):
    with pytest.raises(UserError, match=message):
        build_config(None, flags)


def test_a_plan_that_cannot_fit_the_context_stops_before_anything_is_written(tmp_path):
    with pytest.raises(UserError, match="config field plan_tokens: a prompt of .* do not fit the model's context"):
        train(_config(tmp_path / "run", plan_tokens=1000), **QUIET)
    assert not (tmp_path / "run").exists()
