"""DPO's losses against TRL 1.16's own: the loss and its gradient with respect to the policy's log-probabilities, in
float64, for every loss type localrl has (TRL's DPOTrainer computes the loss inside ``_compute_loss``; it is called
here as TRL runs it, on a stand-in model whose per-token log-probabilities sum to the given ones)."""

from __future__ import annotations

import collections
import types

import pytest
import torch

from localrl.policy.dpo import DPO_LOSS_TYPES, dpo_loss

D = torch.float64
CHOSEN_TOKENS, REJECTED_TOKENS = [2, 4, 7], [5, 3, 1]


def trl_dpo_loss(chosen, rejected, ref_chosen, ref_rejected, loss_type, beta, label_smoothing):
    """TRL's DPOTrainer._compute_loss on these summed log-probabilities (reference log-probs given, as TRL's
    ``precompute_ref_log_probs`` gives them), each completion ``CHOSEN_TOKENS``/``REJECTED_TOKENS`` long."""
    from trl import DPOTrainer

    b = chosen.size(0)
    lengths = CHOSEN_TOKENS + REJECTED_TOKENS
    width = max(lengths) + 2
    completion_mask = torch.zeros(2 * b, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        completion_mask[i, 1:1 + n] = 1
    # each row's whole log-probability on its first completion token: TRL sums over the completion mask
    logps = torch.cat([chosen, rejected])[:, None] * (torch.arange(width - 1) == 0)[None]
    out = types.SimpleNamespace(log_probs=logps, entropy=torch.zeros_like(logps), mean_logits=torch.zeros_like(logps),
                                is_top1=torch.zeros_like(logps, dtype=torch.bool))
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5,
        loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing, use_weighting=False,
        args=types.SimpleNamespace(discopop_tau=0.05, gradient_checkpointing_kwargs=None),
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
        _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(2 * b, width, dtype=torch.long),
              "attention_mask": torch.ones(2 * b, width, dtype=torch.long), "completion_mask": completion_mask,
              "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    return DPOTrainer._compute_loss(trainer, lambda **_: out, inputs, return_outputs=False)


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_the_loss_and_its_gradient_equal_trls(loss_type, beta):
    g = torch.Generator().manual_seed(0)
    chosen, rejected = (-20 * torch.rand(3, generator=g, dtype=D) for _ in range(2))
    ref_chosen, ref_rejected = chosen + torch.randn(3, generator=g, dtype=D), rejected + torch.randn(3, generator=g,
                                                                                                     dtype=D)
    smoothing = 0.2 if loss_type == "robust" else 0.0
    results = []
    for compute in ("localrl", "trl"):
        c, r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
        if compute == "localrl":
            loss, _ = dpo_loss(c, r, ref_chosen, ref_rejected, beta, loss_type, smoothing,
                               torch.tensor(CHOSEN_TOKENS), torch.tensor(REJECTED_TOKENS))
        else:
            loss = trl_dpo_loss(c, r, ref_chosen, ref_rejected, loss_type, beta, smoothing)
        loss.backward()
        results.append((loss.detach(), c.grad, r.grad))
    (ours, dc, dr), (theirs, tc, tr) = results
    assert ours.dtype == theirs.dtype == D and torch.allclose(ours, theirs, rtol=1e-12, atol=0)
    assert torch.allclose(dc, tc, rtol=1e-12, atol=1e-15) and torch.allclose(dr, tr, rtol=1e-12, atol=1e-15)
    assert dc.abs().sum() > 0  # (a gradient that reaches the policy)


def test_statistics_and_bad_settings():
    chosen, rejected = torch.tensor([-1.0, -3.0], dtype=D), torch.tensor([-2.0, -2.0], dtype=D)
    _, stats = dpo_loss(chosen, rejected, torch.full((2,), -2.0, dtype=D), torch.full((2,), -2.0, dtype=D), 0.5)
    assert stats == pytest.approx({"reward_chosen": 0.0, "reward_rejected": 0.0, "reward_margin": 0.0,
                                   "reward_accuracy": 0.5})
    with pytest.raises(ValueError, match="ipo normalises"):
        dpo_loss(chosen, rejected, chosen, rejected, loss_type="ipo")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        dpo_loss(chosen, rejected, chosen, rejected, loss_type="robust", label_smoothing=0.5)
