"""GRPO math: group-relative advantages, masked means, the policy losses of the GRPO family and the KL penalty.

Pure tensor functions with no model in sight, each tested against hand-computed values and against
TRL's own ``GRPOTrainer`` code (tests/test_trl_parity.py). Names and meanings are TRL's:
- advantages are each reward minus its group's mean, divided (``scale_rewards``) by the group's
  unbiased standard deviation (``group``, the GRPO paper's), the whole batch's (``batch``), or not at
  all (``none``, Dr. GRPO's);
- the importance ratio of the policy to the one that sampled is per token, or per sequence
  (``importance_sampling_level = "sequence"``: the exponent of the mean log-ratio, GSPO's);
- the per-token loss is PPO's clipped surrogate with a lower and an upper range (``epsilon``,
  ``epsilon_high``: DAPO's clip-higher) and an optional cap on the unclipped ratio (``delta``:
  INTELLECT-2's two-sided clipping), or CISPO's clipped, detached ratio times the log-probability
  (MiniMax-M1), SAPO's soft sigmoid gate, or VESPO's gamma weight of the sequence ratio; plus
  ``beta`` times the k3 KL estimator against the reference policy, multiplied by the ratio
  (``use_bias_correction_kl``: an unbiased gradient of the reverse KL, as DeepSeek-V3.2);
- how token losses become the step's loss is ``loss_type``: ``grpo`` and ``sapo`` average each
  completion's tokens, then the completions (a long completion's tokens weigh less, which lets wrong
  answers grow long); ``bnpo``, ``dapo``, ``cispo`` and ``vespo`` average over every token of the step;
  ``dr_grpo`` sums the tokens and divides by completions x the longest allowed length, a constant,
  so no length bias; ``luspo`` sums each completion's tokens and averages the completions. The
  divisor is taken from the whole step's batch before it is split into micro-batches
  (``loss_normalizer``), so the gradient never depends on the split;
- completions sampled by another engine (llama.cpp) carry importance weights, the ratio of
  the training policy's probability to the sampler's, truncated or masked as TRL's
  ``vllm_importance_sampling_mode`` does, and multiplied into each token's policy loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, make_dataclass
from typing import NamedTuple

import torch

from localrl.config import IS_MODES, TrainConfig

ADV_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """Advantage of each completion relative to the other completions of its prompt.

    ``rewards`` is [B*G] in prompt-major order; returns [B*G]: the reward minus its group's mean, divided by
    the unbiased standard deviation of the group (``scale="group"``) or of the whole batch (``"batch"``), or
    not (``"none"``). A group whose rewards are all equal gets zero advantage (no signal), never a
    division by zero.
    """
    r = rewards.view(-1, group_size)  # [B, G]
    adv = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = adv / (r.std(dim=1, keepdim=True) + ADV_EPS)
    elif scale == "batch":
        adv = adv / ((r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)) + ADV_EPS)
    elif scale != "none":
        raise ValueError(f"unknown scale_rewards {scale!r}; use group, batch or none")
    flat = (r == r[:, :1]).all(dim=1, keepdim=True)  # exactly 0 there, not the mean's rounding error
    return adv.masked_fill(flat, 0.0).reshape(-1)


def flat_group_share(rewards: torch.Tensor, group_size: int) -> float:
    """The share of groups (``group_size`` consecutive rewards) whose rewards are all alike: no learning signal."""
    return (rewards.view(-1, group_size).std(dim=1) == 0).float().mean().item()


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


# The fields that shape the policy loss, by TRL's names. Their types, defaults, help and checks live once, in
# TrainConfig; LossSettings is the frozen view of them the loss functions take, so that they can be called (and
# checked against TRL) without a whole config.
LOSS_FIELDS = ("loss_type", "epsilon", "epsilon_high", "delta", "importance_sampling_level", "beta",
               "use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
               "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "off_policy_mask_threshold")


def _of(cls, cfg) -> "LossSettings":
    """The loss settings of ``cfg`` (a TrainConfig, or anything with the loss fields)."""
    return cls(**{name: getattr(cfg, name) for name in LOSS_FIELDS})


_CONFIG = {f.name: f for f in fields(TrainConfig)}
LossSettings = make_dataclass(
    "LossSettings", [(name, _CONFIG[name].type, field(default=_CONFIG[name].default)) for name in LOSS_FIELDS],
    frozen=True, namespace={"of": classmethod(_of), "__module__": __name__,
                            "__doc__": "The settings that shape the policy loss (TrainConfig's loss fields)."})


def vespo_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, s: LossSettings,
                  sampler_weights: torch.Tensor | None = None) -> torch.Tensor:
    """VESPO's gradient scale phi(w) = exp(lambda) w^k exp(-lambda w) of the sequence ratio w (the sum of the
    token log-ratios, with the sampler's weights folded in), k and lambda by the advantage's sign; [N, 1],
    no gradient."""
    with torch.no_grad():
        floor = math.log(1e-8)
        log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)  # [N, 1]
        if sampler_weights is not None:
            log_is = torch.log(sampler_weights).clamp(floor, 20.0)
            log_w = log_w + log_is.sum(-1, keepdim=True)
        log_w = log_w.clamp(floor, 20.0)
        positive = advantages >= 0
        k = torch.where(positive, s.vespo_k_pos, s.vespo_k_neg)
        lam = torch.where(positive, s.vespo_lambda_pos, s.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


class TokenTerms(NamedTuple):
    """What a loss type's per-token term is computed from: [N, R] per token, or [N, 1] per completion."""

    logp: torch.Tensor  # the policy's log-probability of each token (with gradient)
    log_ratio: torch.Tensor  # logp minus the log-probability of the policy that sampled, per token
    ratio: torch.Tensor  # the importance ratio: per token, or per completion (GSPO's sequence level)
    advantages: torch.Tensor  # [N, 1] per completion, or [N, R] per token (turn credit)
    mask: torch.Tensor  # 1.0 on the completions' real tokens
    weights: torch.Tensor | None  # the sampler's importance weights ([N, R] or [N, 1]), if any


class PerToken(NamedTuple):
    """A loss type's answer: each token's policy loss, where a clip took the gradient away (for ``clip_frac``; None
    where the type has no clip), and whether the sampler's weights are already folded into it."""

    loss: torch.Tensor
    clipped: torch.Tensor | None = None
    weighted: bool = False


@dataclass(frozen=True)
class LossType:
    """A registered policy loss: its per-token term, and how a step's token losses become the step's loss."""

    name: str
    per_token: Callable[[TokenTerms, "LossSettings"], PerToken]
    completion_mean: bool  # each completion's token mean, then summed over completions; else every token summed
    divisor: str  # what the whole step's summed loss is divided by: "completions", "tokens", "completions x length"

    def normalizer(self, mask: torch.Tensor, max_completion_length: int) -> float:
        rows = mask.size(0)
        if self.divisor == "completions":
            return float(rows)
        if self.divisor == "tokens":
            return max(float(mask.sum()), 1.0)
        return float(rows * max_completion_length)


LOSSES: dict[str, LossType] = {}  # every policy loss, by TRL's name (``loss_type``), in the order registered
DIVISORS = ("completions", "tokens", "completions x length")


def policy_loss(name: str, *, completion_mean: bool = False, divisor: str = "tokens"):
    """Register the decorated per-token term as loss type ``name`` (a function may take several names)."""
    if divisor not in DIVISORS:
        raise ValueError(f"loss type {name}: divisor {divisor!r} is not one of {', '.join(DIVISORS)}")

    def register(fn):
        if name in LOSSES:
            raise ValueError(f"loss type {name} is registered twice")
        LOSSES[name] = LossType(name, fn, completion_mean, divisor)
        return fn
    return register


def registered_loss(name: str) -> LossType:
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss type {name!r}; use one of {', '.join(LOSSES)}") from None


@policy_loss("luspo", divisor="completions")  # (decorators apply bottom-up: grpo is registered first)
@policy_loss("dapo")
@policy_loss("dr_grpo", divisor="completions x length")
@policy_loss("bnpo")
@policy_loss("grpo", completion_mean=True, divisor="completions")
def clipped_surrogate(t: TokenTerms, s: LossSettings) -> PerToken:
    """PPO's clipped surrogate, the clip range [1 - epsilon, 1 + epsilon_high] and the unclipped ratio capped at
    ``delta`` if set (INTELLECT-2's two-sided clipping); where the clip is active the token has no gradient."""
    clipped_ratio = torch.clamp(t.ratio, 1.0 - s.epsilon, 1.0 + (s.epsilon_high or s.epsilon))
    unclipped_ratio = torch.clamp(t.ratio, max=s.delta) if s.delta else t.ratio
    return PerToken(-torch.minimum(unclipped_ratio * t.advantages, clipped_ratio * t.advantages),
                    clipped_ratio * t.advantages < unclipped_ratio * t.advantages)


@policy_loss("cispo")
def cispo(t: TokenTerms, s: LossSettings) -> PerToken:
    """MiniMax-M1's CISPO: the ratio capped at ``epsilon_high`` and detached, times the advantage and the
    log-probability: every token keeps a gradient."""
    cap = s.epsilon_high or s.epsilon
    capped = torch.clamp(t.ratio, max=cap).detach()
    return PerToken(-capped * t.advantages * t.logp, (t.ratio > cap) & (t.advantages > 0))


@policy_loss("sapo", completion_mean=True, divisor="completions")
def sapo(t: TokenTerms, s: LossSettings) -> PerToken:
    """SAPO's soft gate: a sigmoid of the ratio, its temperature by the advantage's sign, in place of the clip."""
    temperature = torch.where(t.advantages > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
    return PerToken(-torch.sigmoid(temperature * (t.ratio - 1.0)) * 4.0 / temperature * t.advantages)


@policy_loss("vespo")
def vespo(t: TokenTerms, s: LossSettings) -> PerToken:
    """VESPO: the advantage times the log-probability, scaled by the gamma weight of the sequence ratio (the
    sampler's weights folded into it)."""
    phi = vespo_weights(t.advantages, t.log_ratio, t.mask, s, t.weights)
    return PerToken(-phi * t.advantages * t.logp, weighted=True)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings = LossSettings(),
    ref_logp: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
    sampling_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of the rows given, not yet divided by ``loss_normalizer`` of the whole batch.

    logp, old_logp, ref_logp, mask: [N, R] per completion token; advantages: [N]; weights: the sampler's
    importance weights ([N, R] or [N, 1]), multiplied into each token's policy loss (not the KL), as TRL
    does; entropy_mask ([N, R] bool): the tokens the policy term keeps (``high_entropy_mask``);
    sampling_logp: the log-probabilities of whoever sampled (default ``old_logp``), for the off-policy mask.
    Returns the sum over rows of each row's token mean (``grpo``, ``sapo``) or of every token's loss
    (the others), so that micro-batches add up exactly to the loss of the whole batch, and statistics.
    """
    s = settings
    kind = registered_loss(s.loss_type)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # [N, 1], or [N, R] per token (turn credit)
    maskf = mask.to(logp.dtype)
    log_ratio = logp - old_logp  # [N, R]
    if s.importance_sampling_level == "sequence":  # GSPO: one ratio per completion, of the mean log-ratio
        log_ratio_used = (log_ratio * maskf).sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp(min=1.0)
    elif s.importance_sampling_level == "token":
        log_ratio_used = log_ratio
    else:
        raise ValueError(f"unknown importance_sampling_level {s.importance_sampling_level!r}; use token or sequence")
    ratio = torch.exp(log_ratio_used)  # [N, R] or [N, 1]
    term = kind.per_token(TokenTerms(logp, log_ratio, ratio, adv, maskf, weights), s)
    per_token = term.loss
    stats: dict[str, float] = {"clip_frac": 0.0}
    if term.clipped is not None:
        stats["clip_frac"] = masked_mean(term.clipped.expand_as(logp).float(), mask).item()
    if s.off_policy_mask_threshold:
        keep = off_policy_mask(adv, logp, old_logp if sampling_logp is None else sampling_logp, maskf,
                               s.off_policy_mask_threshold)
        per_token = per_token * keep
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if weights is not None and not term.weighted:
        per_token = per_token * weights
    if ref_logp is not None and s.beta > 0:
        kl = kl_k3(logp, ref_logp)
        stats["kl"] = masked_mean(kl, mask).item()
        if s.use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + s.beta * kl
    if kind.completion_mean:
        return ((per_token * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)).sum(), stats
    return (per_token * maskf).sum(), stats


def off_policy_mask(advantages: torch.Tensor, logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask ([N, 1], 1 keeps): a completion with a negative advantage
    ([N, 1]) whose mean log-ratio of sampler to policy exceeds ``threshold`` is dropped from the loss."""
    kl = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(logp.dtype)


def high_entropy_threshold(entropies: torch.Tensor, mask: torch.Tensor, top_quantile: float) -> torch.Tensor | None:
    """The entropy at or above which a token is among the ``top_quantile`` most uncertain of ``entropies``
    (all of a step's completion tokens, [N, R], where ``mask``); None when there are none."""
    values = entropies[mask.bool()].float()
    return torch.quantile(values, 1.0 - top_quantile) if values.numel() else None


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
    """[N, R] bool: the real tokens whose entropy is at least ``threshold`` (``high_entropy_threshold``)."""
    if threshold is None:
        return torch.zeros_like(mask, dtype=torch.bool)
    return ((entropies * mask) >= threshold) & mask.bool()


def loss_normalizer(loss_type: str, mask: torch.Tensor, max_completion_length: int) -> float:
    """What the summed loss of a step's batch (``mask``: [N, R], every completion of the step) is divided
    by, as the loss type registers it: N (``grpo``, ``sapo``, ``luspo``), the number of completion tokens
    (``bnpo``, ``dapo``, ``cispo``, ``vespo``), or N x the longest allowed completion (``dr_grpo``). TRL divides
    each micro-batch by its own count for ``bnpo``; here both token-averaged types use the whole batch's, so the
    gradient does not depend on the split."""
    return registered_loss(loss_type).normalizer(mask, max_completion_length)
