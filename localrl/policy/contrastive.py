"""The contrastive term of ``objective = contrastive_grpo``: inside each group, the completions that beat the
group's mean reward (positives) are contrasted with those below it (negatives) by a group-wise InfoNCE over
their length-normalised sequence log-probabilities.

After ConSPO (Zhang et al., "Revisiting Reinforcement Learning with Verifiable Rewards from a Contrastive
Perspective", arXiv 2605.12969): a rollout's score is its mean token log-probability ``s = log pi(o|q) / |o|``;
each positive ``p`` of a group is one softmax "class" against all the group's negatives,

    l_p = -log( exp((s_p - m) / tau) / (exp((s_p - m) / tau) + sum_n exp(s_n / tau)) )

with a margin ``m`` the positive must clear, and a group's term is the mean of its positives' ``l_p``. The
paper's text available here gives this form but not its exact constants or margin schedule, so localrl's is the
closest well-defined version, named as such: the term is added to GRPO's loss with weight ``contrastive_coef``
(GRPO's own term unchanged), the margin rises linearly from 0 to ``contrastive_margin`` over the run, and the
term is averaged over the groups that have both a positive and a negative (the others add nothing).

Exact under micro-batching: the term couples every row of a group, so its gradient is taken in two parts. A
no-grad pass gives every row's score; autograd of the term on those scores gives ``c_i = dL/ds_i``; then each
micro-batch adds ``sum_i c_i * s_i(theta)`` to its loss, whose gradient is ``sum_i c_i ds_i/dtheta``, the term's
own (the chain rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Contrast:
    """The term's settings at one step."""

    coef: float  # its weight beside GRPO's loss
    temperature: float  # tau
    margin: float  # m at this step

    @classmethod
    def at(cls, cfg, step: int) -> "Contrast":
        """The configured term at 0-based ``step``: the margin ramps linearly to ``contrastive_margin`` at the
        last step."""
        ramp = (step + 1) / max(cfg.steps, 1)
        return cls(cfg.contrastive_coef, cfg.contrastive_temperature, cfg.contrastive_margin * min(ramp, 1.0))


def sequence_scores(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] mean log-probability of each row's trained tokens (0 for a row with none)."""
    mask = mask.to(logp.dtype)
    return (logp * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def contrast_labels(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] +1 for a positive (above its group's mean: a positive advantage), -1 for a negative, 0 otherwise;
    token advantages ([N, R]) are judged by their sum over the trained tokens."""
    per_row = advantages if advantages.dim() == 1 else (advantages * mask.to(advantages.dtype)).sum(-1)
    return torch.sign(per_row)


def contrasted_groups(labels: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] whether each group has both a positive and a negative (the groups the term covers)."""
    by_group = labels.view(-1, group_size)
    return (by_group > 0).any(-1) & (by_group < 0).any(-1)


def contrastive_loss(scores: torch.Tensor, labels: torch.Tensor, group_size: int, temperature: float,
                     margin: float) -> tuple[torch.Tensor, int]:
    """(the sum over groups of each group's mean positive InfoNCE loss, the number of groups that have both a
    positive and a negative). ``scores``, ``labels``: [N] in groups of ``group_size`` rows."""
    s = scores.view(-1, group_size) / temperature
    pos = labels.view(-1, group_size) > 0
    neg = labels.view(-1, group_size) < 0
    contrasted = contrasted_groups(labels, group_size)
    if not contrasted.any():
        return scores.sum() * 0, 0
    s, pos, neg = s[contrasted], pos[contrasted], neg[contrasted]
    shifted = s - margin / temperature
    # log of each group's sum over its negatives (-inf-free: every kept group has one)
    negatives = torch.logsumexp(s.masked_fill(~neg, float("-inf")), dim=-1, keepdim=True)
    per_positive = torch.logaddexp(shifted, negatives) - shifted  # -log softmax of the positive against them
    per_group = (per_positive * pos).sum(-1) / pos.sum(-1)
    return per_group.sum(), int(contrasted.sum())


def score_coefficients(scores: torch.Tensor, labels: torch.Tensor, group_size: int, contrast: Contrast,
                       groups: int) -> tuple[torch.Tensor, float]:
    """(``coef / groups x dL/ds``: what each row's score is multiplied by in the loss, the term's value
    ``coef x L / groups``); ``groups``: the count the term is averaged over (every rank's, under torchrun)."""
    s = scores.detach().double().requires_grad_(True)
    total, _ = contrastive_loss(s, labels, group_size, contrast.temperature, contrast.margin)
    scale = contrast.coef / max(groups, 1)
    if not total.requires_grad:
        return torch.zeros_like(scores), 0.0
    (grad,) = torch.autograd.grad(total, s)
    return (grad * scale).to(scores.dtype), total.item() * scale
