"""PPO with a critic: GAE, whitening, the per-token rewards and the value and policy losses against hand-computed
values and a float64 reference written from the papers (TRL 1.16 no longer has PPO to test against); the update's
gradient does not depend on the micro-batch size; a run resumes exactly; bad settings are one line; PPO trains
an agent in the shell too."""

from __future__ import annotations

import pytest
import torch

from localrl.config import TrainConfig
from localrl.errors import UserError
from localrl.policy.ppo import gae, policy_loss, token_rewards, value_loss, whiten
from localrl.training.loop import train
from localrl.training.settings import check_config
from tests.helpers import QUIET, small, train_records


def reference_gae(rewards, values, mask, gamma, lam):
    """GAE row by row over the trained tokens only, in Python floats (float64)."""
    advantages = torch.zeros_like(rewards, dtype=torch.float64)
    for i in range(rewards.size(0)):
        steps = [t for t in range(rewards.size(1)) if mask[i, t]]
        running, following = 0.0, 0.0
        for t in reversed(steps):
            delta = float(rewards[i, t]) + gamma * following - float(values[i, t])
            running = delta + gamma * lam * running
            advantages[i, t] = running
            following = float(values[i, t])
    return advantages


def test_gae_by_hand():
    r, v = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64), torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    adv, ret = gae(r, v, torch.ones(1, 3), gamma=0.9, lam=0.8)
    # t2: 1 - 0.7 = 0.3; t1: 0.9 * 0.7 - 0.6 + 0.72 * 0.3 = 0.246; t0: 0.9 * 0.6 - 0.5 + 0.72 * 0.246 = 0.21712
    assert adv[0].tolist() == pytest.approx([0.21712, 0.246, 0.3])
    assert ret[0].tolist() == pytest.approx([0.71712, 0.846, 1.0])
    # an environment's token between two turns is skipped: the first token bootstraps from the third's value
    adv, ret = gae(torch.tensor([[0.0, 5.0, 1.0]], dtype=torch.float64), v, torch.tensor([[1, 0, 1]]), 0.9, 0.8)
    assert adv[0].tolist() == pytest.approx([0.13 + 0.72 * 0.3, 0.0, 0.3]) and ret[0, 1] == 0


def test_gae_equals_the_reference_on_random_rows():
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(6, 9, generator=g, dtype=torch.float64), torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 9, generator=g) < 0.7
    adv, ret = gae(r, v, mask, gamma=0.97, lam=0.9)
    want = reference_gae(r, v, mask, 0.97, 0.9)
    assert torch.allclose(adv, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(ret, (want + v) * mask, rtol=1e-12, atol=1e-12)


def test_whitening_is_over_the_trained_tokens_only():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    w = whiten(x, mask)
    kept = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    want = (kept - kept.mean()) / kept.std()  # unbiased, as TRL's masked_whiten
    assert torch.allclose(w[mask.bool()], want, atol=1e-7) and (w[~mask.bool()] == 0).all()


def test_rewards_are_the_score_at_the_last_trained_token_less_the_kl():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    rewards, kl = token_rewards(torch.tensor([1.0, 1.0]), old, ref, mask, kl_coef=0.1)
    assert rewards.flatten().tolist() == pytest.approx([-0.05, 1.0, 0.0, 0.0, 0.0, 0.0])  # k1 KL: 0.5, 0, masked
    assert kl.flatten().tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0, 0.0, 0.0])


def test_the_value_loss_clips_as_trl_defined_it():
    returns, old = torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.5, 0.5, 0.5])
    values = torch.tensor([1.0, 0.0, 0.9])
    # 1: plain 1.0 > clipped (0.7 - 0)^2 = 0.49; 2: plain 1.0 > (0.3 - 1)^2; 3: clipped (0.7 - 1)^2 = 0.09 > 0.01
    loss, clipped = value_loss(values, old, returns, torch.ones(3), cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0 + 0.09)) and clipped.item() == pytest.approx(1 / 3)
    logp, old_logp = torch.log(torch.tensor([1.5, 0.5])), torch.zeros(2)
    loss, clip_frac = policy_loss(logp, old_logp, torch.tensor([1.0, 1.0]), torch.ones(2), 0.2, 0.2)
    assert loss.item() == pytest.approx(-(1.2 + 0.5)) and clip_frac.item() == 0.5


def test_the_update_does_not_depend_on_the_micro_batch(builtin_model):
    """One epoch, one mini-batch: micro-batches of 1 row and of all rows step the adapter and the critic alike."""
    from localrl.data import load_task
    from localrl.generation.rollout import encode_prompts, group_generators, sample_in_chunks, stop_token_ids
    from localrl.modeling import load_policy
    from localrl.policy.ppo import Critic, ppo_update

    cfg = TrainConfig(objective="ppo", num_ppo_epochs=1, group_size=4, prompts_per_step=2, max_new_tokens=24,
                      kl_coef=0.1).validate()
    results = []
    for micro in (1, 0):
        torch.manual_seed(0)
        model, tok = load_policy(cfg, torch.device("cpu"), False)
        rows = load_task("arith", "", 0).sample(0, 2, 0)
        prompts = encode_prompts(tok, rows)
        rollout = sample_in_chunks(model, prompts, 4, 24, stop_token_ids(tok, model), tok.pad_token_id, 1.0,
                                   group_generators(1, range(2), torch.device("cpu")), 2)
        critic = Critic(model.config.hidden_size)
        params = [p for p in model.parameters() if p.requires_grad]
        opt, copt = torch.optim.SGD(params, lr=1.0), torch.optim.SGD(critic.parameters(), lr=1.0)
        scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
        stats = ppo_update(model, critic, opt, copt, rollout, scores, cfg, micro_batch=micro)
        results.append(([p.detach().clone() for p in params], critic.head.weight.detach().clone(), stats))
    (a, ca, sa), (b, cb, sb) = results
    assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(a, b))
    assert torch.allclose(ca, cb, rtol=1e-4, atol=1e-6) and ca.abs().sum() > 0
    assert sa["loss"] == pytest.approx(sb["loss"], rel=1e-4)


def test_a_ppo_run_trains_its_value_head(builtin_model, tmp_path):
    """(Its resume: tests/test_resume_contract.py.)"""
    result = train(small(tmp_path / "run", objective="ppo", steps=2, num_ppo_epochs=2), **QUIET)
    records = train_records(result.run_dir)
    assert all(r["vf_loss"] > 0 for r in records) and records[-1]["value_mean"] != 0


@pytest.mark.parametrize("flags, message", [
    ({"objective": "ppo", "kl_estimator": "k2"}, "config field kl_estimator: must be k1 or k3"),
    ({"objective": "ppo", "lam": 1.5}, "config field lam: must be in"),
    ({"objective": "ppo", "num_mini_batches": 32}, "config field num_mini_batches: must be at most prompts_per_step"),
    ({"gamma": 0.9}, "config field gamma: needs objective ppo"),
])
def test_bad_ppo_settings_are_one_line(flags, message):
    with pytest.raises(UserError, match=message):
        check_config(TrainConfig(**flags))


@pytest.mark.slow
def test_ppo_trains_an_agent_in_the_shell(tmp_path):
    from localrl.training.settings import build_config

    cfg = build_config(None, {"env": "shell", "objective": "ppo", "steps": 1, "prompts_per_step": 2, "group_size": 2,
                              "eval_size": 0, "run_dir": str(tmp_path / "run")})
    result = train(cfg, **QUIET)
    record = train_records(result.run_dir)[0]
    assert result.steps_done == 1 and record["vf_loss"] >= 0 and "turns" in record


@pytest.mark.slow
def test_ppo_raises_held_out_accuracy_on_the_built_in_task(builtin_model, tmp_path):
    result = train(small(tmp_path / "run", steps=10, objective="ppo", eval_size=64, prompts_per_step=8,
                         group_size=8), **QUIET)
    assert result.eval_after["accuracy"] >= result.eval_before["accuracy"] + 0.3  # measured: 40.6% -> 98.4%
