"""GRPO math: group-relative advantages, masked means, the clipped policy loss and the KL penalty.

Pure tensor functions with no model in sight, so each is tested against hand-computed values.
Conventions follow the GRPO paper (DeepSeekMath) and TRL's ``loss_type="grpo"``:
- advantages are standardised within each prompt's group: (r - mean) / (std + eps),
  with the unbiased standard deviation;
- the per-token loss is PPO's clipped surrogate, plus ``beta`` times the k3 KL estimator
  against the reference (base) policy;
- how token losses become the step's loss is TRL's ``loss_type``: ``grpo`` averages each
  completion's tokens, then the completions (the paper's; a long completion's tokens weigh less,
  which lets wrong answers grow long); ``bnpo`` and ``dapo`` (DAPO) average over every token of the
  step; ``dr_grpo`` (Dr. GRPO) sums the tokens and divides by completions x the longest allowed
  length, a constant, so no length bias. The divisor is taken from the whole step's batch before
  it is split into micro-batches (``loss_normalizer``), so the gradient never depends on the split;
- completions sampled by another engine (llama.cpp) carry importance weights, the ratio of
  the training policy's probability to the sampler's, truncated or masked as TRL's
  ``vllm_importance_sampling_mode`` does, and multiplied into each token's loss.
"""

from __future__ import annotations

import torch

from localrl.config import IS_MODES, LOSS_TYPES

ADV_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """Advantage of each completion relative to the other completions of its prompt.

    ``rewards`` is [B*G] in prompt-major order; returns [B*G]. A group whose rewards are
    all equal gets zero advantage (no signal), never a division by zero.
    """
    r = rewards.view(-1, group_size)  # [B, G]
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True) + ADV_EPS)
    flat = (r == r[:, :1]).all(dim=1, keepdim=True)  # exactly 0 there, not the mean's rounding error
    return adv.masked_fill(flat, 0.0).reshape(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (all of them, or along ``dim``)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimator of KL(policy || reference): exp(d) - d - 1 with d = ref - logp; >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def importance_weights(logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str = "sequence_mask",
                       cap: float = 3.0) -> torch.Tensor:
    """Importance weights correcting for completions sampled by another engine than the policy being trained.

    logp (the policy, no gradient), sampler_logp, mask: [N, R]. The ratio exp(logp - sampler_logp) per token,
    or per sequence (summed log-ratios) for ``sequence_*`` modes, is clipped at ``cap`` (``*_truncate``) or
    zeroed above it (``*_mask``). Returns [N, R] (token modes) or [N, 1] (sequence modes).
    """
    diff = (logp - sampler_logp) * mask  # [N, R]
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)  # [N, 1]
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    if mode.endswith("mask"):
        return ratio.masked_fill(ratio > cap, 0.0)
    raise ValueError(f"unknown importance sampling mode {mode!r}; use one of {', '.join(IS_MODES)}")


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float = 0.2,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    weights: torch.Tensor | None = None,
    loss_type: str = "grpo",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped GRPO loss of the rows given, not yet divided by ``loss_normalizer`` of the whole batch.

    logp, old_logp, ref_logp, mask: [N, R] per completion token; advantages: [N]; weights: importance
    weights ([N, R] or [N, 1]) multiplied into each token's loss, KL included, as TRL does.
    Returns the sum over rows of each row's token-mean loss (``grpo``) or of every token's loss
    (the others), so that micro-batches add up exactly to the loss of the whole batch, and per-batch
    statistics.
    """
    ratio = torch.exp(logp - old_logp)  # [N, R]
    adv = advantages[:, None]  # [N, 1]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon) * adv
    per_token = -torch.minimum(unclipped, clipped)  # [N, R]
    stats = {"clip_frac": masked_mean((clipped < unclipped).float(), mask).item()}  # clip active: no gradient
    if ref_logp is not None and beta > 0:
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + beta * kl
        stats["kl"] = masked_mean(kl, mask).item()
    if weights is not None:
        per_token = per_token * weights
    if loss_type == "grpo":
        loss = masked_mean(per_token, mask, dim=1).sum()
    elif loss_type in LOSS_TYPES:
        loss = (per_token * mask.to(per_token.dtype)).sum()
    else:
        raise ValueError(f"unknown loss type {loss_type!r}; use one of {', '.join(LOSS_TYPES)}")
    return loss, stats


def loss_normalizer(loss_type: str, mask: torch.Tensor, max_completion_length: int) -> float:
    """What the summed loss of a step's batch (``mask``: [N, R], every completion of the step) is divided
    by: N for ``grpo``, the number of completion tokens for ``bnpo`` and ``dapo``, N x the longest
    allowed completion for ``dr_grpo``. TRL divides each micro-batch by its own count for ``bnpo``;
    here both token-averaged types use the whole batch's, so the gradient does not depend on the split."""
    rows = mask.size(0)
    if loss_type == "grpo":
        return float(rows)
    if loss_type in ("bnpo", "dapo"):
        return max(float(mask.sum()), 1.0)
    if loss_type == "dr_grpo":
        return float(rows * max_completion_length)
    raise ValueError(f"unknown loss type {loss_type!r}; use one of {', '.join(LOSS_TYPES)}")
