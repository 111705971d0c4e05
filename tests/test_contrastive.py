"""Contrastive GRPO (objective contrastive_grpo): the group-wise InfoNCE term against values computed by hand,
its gradient through micro-batches against autograd of the term written plainly, its settings, and a run that
trains and resumes exactly."""

from __future__ import annotations

import math

import pytest
import torch

from localrl.config import TrainConfig
from localrl.errors import UserError
from localrl.modeling import load_policy, pick_device
from localrl.policy.contrastive import Contrast, contrast_labels, contrastive_loss, sequence_scores
from localrl.policy.grpo import policy_update
from localrl.policy.losses import group_advantages
from localrl.policy.shared_prompt import ConcatForward
from localrl.training.loop import resume_config, train
from localrl.training.settings import build_config
from tests.helpers import QUIET, randomise_lora, rel_err, small, train_records
from tests.test_prompt_cache import make_rollout

D = torch.float64


def test_the_term_equals_the_values_computed_by_hand():
    # group 1: positives -1.0 and -0.5 against negatives -2.0 and -3.0; group 2: all alike (no contrast);
    # group 3: one positive -0.2 against one negative -0.1 (the wrong one is the likelier)
    scores = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0, -1.0, -1.0, -1.0, -0.2, -0.1, -9.0, -9.0], dtype=D)
    rewards = torch.tensor([1, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0.5, 0.5], dtype=D)
    labels = contrast_labels(group_advantages(rewards, 4), torch.ones(12, 1))
    assert labels.tolist() == [1, -1, 1, -1, 0, 0, 0, 0, 1, -1, 0, 0]

    def by_hand(tau, m):
        def nll(p, negatives):
            return -math.log(math.exp((p - m) / tau) / (math.exp((p - m) / tau) + sum(math.exp(n / tau)
                                                                                      for n in negatives)))
        return (nll(-1.0, [-2.0, -3.0]) + nll(-0.5, [-2.0, -3.0])) / 2 + nll(-0.2, [-0.1])

    for tau, m in ((1.0, 0.0), (0.1, 0.0), (0.5, 0.3)):
        total, groups = contrastive_loss(scores, labels, 4, tau, m)
        assert groups == 2 and total.item() == pytest.approx(by_hand(tau, m), rel=1e-12)
    assert contrastive_loss(scores, torch.zeros(12), 4, 1.0, 0.0)[1] == 0
    # the margin ramps to its value at the last step
    cfg = TrainConfig(objective="contrastive_grpo", contrastive_margin=0.4, steps=4).validate()
    assert [Contrast.at(cfg, s).margin for s in range(4)] == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_sequence_scores_are_mean_log_probs_of_the_trained_tokens():
    logp = torch.tensor([[-1.0, -3.0, -7.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert sequence_scores(logp, mask).tolist() == [-2.0, 0.0]


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_the_update_adds_the_terms_exact_gradient_through_micro_batches(builtin_model, num_iterations):
    """policy_update with the term minus policy_update without it is the gradient of coef x term / groups,
    by autograd through one plain concatenated forward of the whole batch (a group with tied rewards left out)."""
    cfg = TrainConfig(model=str(builtin_model), quantize="none", objective="contrastive_grpo", beta=0.0,
                      max_grad_norm=0, num_iterations=num_iterations, contrastive_coef=0.7,
                      contrastive_temperature=0.5).validate()
    torch.manual_seed(0)
    model, tok = load_policy(cfg, pick_device("cpu"))
    randomise_lora(model)
    rollout = make_rollout(len(tok), tok.pad_token_id)  # 3 groups of 3
    rewards = torch.tensor([0.0, 1.0, 0.5, 1.0, 0.0, 0.0, 0.3, 0.3, 0.3], dtype=D)
    advantages = group_advantages(rewards, 3).float()
    contrast = Contrast(0.7, 0.5, 0.2)
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    model.train()
    model.zero_grad(set_to_none=True)
    with ConcatForward(model, rollout) as fwd:
        scores = sequence_scores(fwd.logprobs(slice(0, 9)), rollout.completion_mask)
    labels = contrast_labels(advantages, rollout.completion_mask)
    term, groups = contrastive_loss(scores, labels, 3, 0.5, 0.2)
    assert groups == 2
    (term * 0.7 / groups).backward()
    plain = {k: p.grad.clone() for k, p in params.items()}
    assert all(g.abs().sum() > 0 for g in plain.values())
    optimizer = torch.optim.SGD(params.values(), lr=0.0)  # (a step that moves nothing: the gradients are compared)
    for micro_batch, prompt_cache in ((0, True), (2, True), (1, False)):
        run_cfg = TrainConfig(**{**cfg.to_dict(), "prompt_cache": prompt_cache})
        policy_update(model, optimizer, rollout, advantages, run_cfg, micro_batch)
        without = {k: p.grad.clone() for k, p in params.items()}
        stats = policy_update(model, optimizer, rollout, advantages, run_cfg, micro_batch, contrast=contrast)
        assert stats["contrastive"] == pytest.approx(term.item() * 0.7 / groups, rel=1e-5)
        for k, p in params.items():
            assert rel_err(p.grad - without[k], plain[k]) <= 1e-4, (micro_batch, prompt_cache, k)


@pytest.mark.parametrize("flags, message", [
    ({"objective": "contrastive_grpo", "contrastive_temperature": 0}, "config field contrastive_temperature: must "
                                                                      "be positive"),
    ({"objective": "contrastive_grpo", "contrastive_coef": -1}, "config field contrastive_coef: must be at least 0"),
    ({"objective": "contrastive_grpo", "contrastive_margin": -0.1}, "config field contrastive_margin: must be at"),
    ({"contrastive_coef": 2.0}, "config field contrastive_coef: needs objective contrastive_grpo"),
    ({"objective": "contrastive_grpo", "markovian_chunk": 16}, "config field markovian_chunk: objective "
                                                               "contrastive_grpo contrasts whole completions"),
])
def test_bad_settings_are_one_line(flags, message):
    with pytest.raises(UserError, match=message):
        build_config(None, flags)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [{"sampler": "prefix_tree", "group_size": 4},
                                   {"sampler": "plan_then_act", "plan_count": 2, "plan_tokens": 8, "group_size": 2}],
                         ids=["prefix_tree", "plan_then_act"])
def test_a_contrastive_step_runs_over_the_samplers_that_shape_the_groups(builtin_model, tmp_path, flags):
    """contrastive_grpo is a GRPO (``group_relative``), so the samplers that form the groups themselves (a prefix
    tree's, each prompt's plans) take it as they take grpo, and its term is computed over their groups."""
    result = train(small(tmp_path / "run", objective="contrastive_grpo", contrastive_coef=1.0, steps=1,
                         prompts_per_step=2, **flags), **QUIET)
    [record] = train_records(result.run_dir)
    assert record["contrastive"] is not None and math.isfinite(record["loss"])


@pytest.mark.slow
def test_a_contrastive_run_trains_and_resumes_exactly(builtin_model, tmp_path):
    kw = dict(objective="contrastive_grpo", contrastive_margin=0.1, steps=3, prompts_per_step=4, group_size=4)
    full = train(small(tmp_path / "full", **kw), **QUIET)
    records = train_records(full.run_dir)
    assert any(r["contrastive"] > 0 for r in records) and all("contrastive" in r for r in records)

    def stop_after_step_2(record):  # Ctrl-C after the second step (the margin's ramp is of the run's 3 steps)
        if record.get("kind") == "train" and record["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(small(tmp_path / "part", **kw), listeners=[stop_after_step_2], **QUIET)
    assert len(train_records(tmp_path / "part")) == 2
    train(resume_config(tmp_path / "part", {}), resume=True, **QUIET)
    assert train_records(tmp_path / "part") == records
