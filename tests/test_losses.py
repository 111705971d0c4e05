"""GRPO math against values computed by hand."""

import math

import pytest
import torch

from localrl.policy.losses import LossSettings, grpo_loss, group_advantages, kl_k3, masked_mean


def test_group_advantages_standardise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0,   2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, group_size=4)
    # group 1: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = 0.57735
    std = math.sqrt(1 / 3)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4)
    assert torch.allclose(adv[:4], expected, atol=1e-6)
    # group 2: all equal -> no signal, and no division by zero
    assert torch.equal(adv[4:], torch.zeros(4))


def test_group_advantages_unscaled_are_centred_rewards():
    adv = group_advantages(torch.tensor([3.0, 1.0]), group_size=2, scale="none")
    assert adv.tolist() == [1.0, -1.0]


def test_masked_mean_ignores_padding():
    x = torch.tensor([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(x, m).item() == pytest.approx(7 / 3)
    assert masked_mean(x, m, dim=1).tolist() == [1.5, 4.0]


def test_kl_k3_matches_formula_and_is_zero_at_equality():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -2.0])
    d = -0.5
    assert kl_k3(logp, ref)[0].item() == pytest.approx(math.exp(d) - d - 1)
    assert kl_k3(logp, ref)[1].item() == 0.0


def test_grpo_loss_on_policy_equals_minus_mean_advantage():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = grpo_loss(logp, logp.detach(), adv, mask)
    # ratio 1 everywhere: row losses -2 and +1, summed over rows
    assert loss.item() == pytest.approx(-1.0)
    assert stats["clip_frac"] == 0.0
    loss.backward()
    # d(loss)/d(logp) = -A / (tokens in the row) on real tokens, 0 on padding
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_grpo_loss_clips_the_ratio_by_sign_of_advantage():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]])
    mask = torch.ones(1, 2)
    # positive advantage: ratio 1.5 is clipped to 1.2; ratio 0.5 is kept (min picks it)
    loss, stats = grpo_loss(logp, old, torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    assert stats["clip_frac"] == pytest.approx(0.5)
    # negative advantage: ratio 1.5 is kept (-1.5), ratio 0.5 is clipped to 0.8
    loss, _ = grpo_loss(logp, old, torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx((1.5 + 0.8) / 2)


def test_grpo_loss_adds_beta_times_kl():
    logp = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2)
    loss, stats = grpo_loss(logp, logp, torch.tensor([0.0]), mask, LossSettings(beta=0.1), ref_logp=ref)
    kl0 = math.exp(-0.5) + 0.5 - 1
    assert stats["kl"] == pytest.approx(kl0 / 2)
    assert loss.item() == pytest.approx(0.1 * kl0 / 2)


def test_grpo_loss_micro_batches_add_up_to_the_full_batch():
    torch.manual_seed(0)
    logp, old = torch.randn(6, 5), torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).long()
    mask[:, 0] = 1
    adv = torch.randn(6)
    full, _ = grpo_loss(logp, old, adv, mask)
    parts = sum(grpo_loss(logp[s], old[s], adv[s], mask[s])[0] for s in (slice(0, 2), slice(2, 6)))
    assert torch.allclose(full, parts)


def test_importance_weights_in_the_four_modes():
    from localrl.policy.losses import importance_weights

    logp = torch.log(torch.tensor([[0.5, 0.5, 0.1], [0.2, 0.9, 0.9]]))
    sampler = torch.log(torch.tensor([[0.25, 0.5, 0.9], [0.2, 0.1, 0.9]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the first row's last token is padding: it must not count
    token = torch.tensor([[2.0, 1.0, 1.0], [1.0, 9.0, 1.0]])  # p / q per token (1 where masked)
    assert torch.allclose(importance_weights(logp, sampler, mask, "token_truncate", 3.0),
                          torch.tensor([[2.0, 1.0, 1.0], [1.0, 3.0, 1.0]]))
    assert torch.allclose(importance_weights(logp, sampler, mask, "token_mask", 3.0),
                          torch.tensor([[2.0, 1.0, 1.0], [1.0, 0.0, 1.0]]))
    sequence = token.prod(dim=1, keepdim=True)  # [[2], [9]]
    assert torch.allclose(importance_weights(logp, sampler, mask, "sequence_truncate", 3.0), sequence.clamp(max=3))
    assert torch.allclose(importance_weights(logp, sampler, mask, "sequence_mask", 3.0), torch.tensor([[2.0], [0.0]]))


def test_importance_weights_multiply_each_tokens_loss():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv, mask = torch.tensor([1.0]), torch.tensor([[1, 1]])
    plain, _ = grpo_loss(logp, logp.detach(), adv, mask)
    weighted, _ = grpo_loss(logp, logp.detach(), adv, mask, weights=torch.tensor([[2.0, 0.0]]))
    assert plain.item() == pytest.approx(-1.0) and weighted.item() == pytest.approx(-1.0)  # (2*-1 + 0*-1) / 2
    (grad,) = torch.autograd.grad(weighted, logp)
    assert torch.allclose(grad, torch.tensor([[-1.0, 0.0]]))  # the zero-weight token gets no gradient


def test_scale_rewards_by_group_batch_or_none():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])  # groups of 2: means 0.5 and 2.0
    centred = torch.tensor([0.5, -0.5, 1.0, -1.0])
    assert torch.allclose(group_advantages(rewards, 2, "none"), centred)
    group_std = torch.tensor([math.sqrt(0.5)] * 2 + [math.sqrt(2.0)] * 2)
    assert torch.allclose(group_advantages(rewards, 2, "group"), centred / (group_std + 1e-4))
    batch_std = rewards.std()  # unbiased, over the whole batch
    assert torch.allclose(group_advantages(rewards, 2, "batch"), centred / (batch_std + 1e-4))
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, 2, "rows")


def test_sequence_level_ratio_is_one_per_completion():
    """GSPO: every token of a completion shares exp(mean log-ratio), so clipping keeps or drops it whole."""
    old = torch.zeros(1, 3)
    logp = torch.tensor([[math.log(2.0), 0.0, math.log(0.5)]])  # mean log-ratio 0: sequence ratio 1
    mask = torch.ones(1, 3)
    token, stats_t = grpo_loss(logp, old, torch.tensor([1.0]), mask)
    sequence, stats_s = grpo_loss(logp, old, torch.tensor([1.0]), mask, LossSettings(importance_sampling_level="sequence"))
    assert token.item() == pytest.approx(-(1.2 + 1.0 + 0.5) / 3) and stats_t["clip_frac"] == pytest.approx(1 / 3)
    assert sequence.item() == pytest.approx(-1.0) and stats_s["clip_frac"] == 0.0


def test_the_loss_settings_are_the_configs_loss_fields():
    """One copy of the loss fields: LossSettings takes its fields and defaults from TrainConfig."""
    from dataclasses import fields

    from localrl.config import TrainConfig
    from localrl.policy.losses import LOSS_FIELDS

    assert LossSettings() == LossSettings.of(TrainConfig())  # the same defaults (beta included)
    assert LossSettings.of(TrainConfig(loss_type="dapo", beta=0.1, epsilon_high=0.28)) == \
        LossSettings("dapo", beta=0.1, epsilon_high=0.28)
    assert {f.name: f.default for f in fields(LossSettings)} == \
        {f.name: f.default for f in fields(TrainConfig) if f.name in LOSS_FIELDS}


def test_a_loss_is_one_registered_function_that_a_run_can_name():
    """A new loss type is one decorated function: the config takes its name, and the step's loss sums its per-token
    term and divides by what it registered; every registered name is in --loss-type's help."""
    from localrl.config import FIELDS
    from localrl.errors import UserError
    from localrl.policy.losses import LOSSES, PerToken, loss_normalizer, policy_loss
    from localrl.training.settings import build_config

    assert all(name in FIELDS["loss_type"].metadata["help"] for name in LOSSES)
    with pytest.raises(UserError, match="loss_type: must be one of grpo, .*vespo for objective grpo"):
        build_config(None, {"loss_type": "reinforce"})
    policy_loss("reinforce", divisor="completions")(lambda t, s: PerToken(-t.advantages * t.logp))
    try:
        assert build_config(None, {"loss_type": "reinforce"}).loss_type == "reinforce"
        logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
        mask = torch.tensor([[1, 1], [1, 0]])
        loss, stats = grpo_loss(logp, logp, torch.tensor([1.0, -2.0]), mask, LossSettings("reinforce", beta=0.0))
        assert loss.item() == pytest.approx(3.0 - 1.0) and stats["clip_frac"] == 0.0  # (1 + 2) + (-2 x 0.5)
        assert loss_normalizer("reinforce", mask, 2) == 2.0
        with pytest.raises(ValueError, match="registered twice"):
            policy_loss("reinforce")(lambda t, s: PerToken(t.logp))
    finally:
        del LOSSES["reinforce"]
