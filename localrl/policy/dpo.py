"""Direct preference optimisation's losses (Rafailov et al. 2023, and its variants), with TRL's names and formulas
(TRL 1.16's ``DPOTrainer``; tests/test_dpo.py checks losses and gradients against TRL's own code).

For a pair of completions of one prompt, the chosen y_w and the rejected y_l, with log-probabilities summed over each
completion's tokens under the policy (log pi) and the reference (log pi_ref, for a LoRA run the base with the adapter
off), the margin is

    h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))

and the loss of the pair, by ``loss_type``:

- ``sigmoid`` (DPO): -log sigmoid(beta h);
- ``hinge`` (SLiC): max(0, 1 - beta h);
- ``ipo`` (Azar et al. 2023): (h' - 1 / (2 beta))^2, where h' is h with each log-ratio divided by its completion's
  token count (TRL's length-normalised form, as its authors confirmed to TRL);
- ``robust`` (Chowdhury et al. 2024, noisy labels): (-(1 - e) log sigmoid(beta h) + e log sigmoid(-beta h)) /
  (1 - 2e), e = ``label_smoothing``, the assumed share of flipped labels.

The loss of a batch is the mean over its pairs. The implicit rewards TRL logs are beta x each log-ratio.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The mean loss of B pairs ([B] summed log-probabilities each) and its statistics: the implicit rewards of the
    chosen and rejected completions, their margin, and the share of pairs whose chosen reward is the higher.
    ``chosen_tokens``/``rejected_tokens`` ([B] token counts) are needed by ``ipo`` only."""
    chosen = chosen_logps - ref_chosen_logps
    rejected = rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen - rejected))
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * (chosen - rejected))
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("ipo normalises each log-ratio by its completion's length: give the token counts")
        per_token = chosen / chosen_tokens.clamp(min=1) - rejected / rejected_tokens.clamp(min=1)
        losses = (per_token - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(f"robust: label_smoothing must be in [0, 0.5) (got {label_smoothing})")
        margin = beta * (chosen - rejected)
        losses = (-(1 - label_smoothing) * F.logsigmoid(margin) + label_smoothing * F.logsigmoid(-margin)) / \
            (1 - 2 * label_smoothing)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; use one of {', '.join(DPO_LOSS_TYPES)}")
    with torch.no_grad():
        reward_chosen, reward_rejected = beta * chosen, beta * rejected
        stats = {"reward_chosen": reward_chosen.mean().item(), "reward_rejected": reward_rejected.mean().item(),
                 "reward_margin": (reward_chosen - reward_rejected).mean().item(),
                 "reward_accuracy": (reward_chosen > reward_rejected).double().mean().item()}
    return losses.mean(), stats
