"""PPO with a learned critic (Schulman et al., 2017; the RLHF form of Ouyang et al., 2022, as TRL's PPOTrainer had it):
the maths and the update of one step on a finished rollout. The step itself is the ``ppo`` objective's
(``localrl.objectives.ppo``).

- **The critic** is a linear head on the policy's last hidden state (``Critic``): the trunk is shared, so its
  values cost one matrix-vector product per token of a forward that runs anyway, and no second adapter or model
  is held. Its gradient reaches the LoRA adapter through the trunk, weighted by ``vf_coef``, as in TRL's
  value-head models. Zero-initialised: every value starts at 0.
- **Per-token rewards**: ``-kl_coef x KL`` of each trained token to the reference (``kl_estimator`` k1:
  log pi_old - log pi_ref, or k3), plus the sequence's score on its last trained token.
- **GAE** (``gamma``, ``lam``) runs backwards over the trained tokens of each row only: in an agent's episode
  the environment's tokens are skipped, so a turn's last token bootstraps from the next turn's first value.
- **Advantages are whitened** over the batch's trained tokens (mean 0, unbiased variance 1), as TRL does.
- **Losses**: the clipped policy loss per token (``epsilon``, ``epsilon_high``), the clipped value loss
  ``0.5 max((v - R)^2, (clip(v, v_old +- cliprange_value) - R)^2)`` (``cliprange_value``), each a mean over the
  mini-batch's trained tokens, summed as ``pg + vf_coef * vf``; ``beta`` adds GRPO's k3 KL to the loss as
  well (KL in the reward and KL in the loss are separate settings, as TRL names them).
- ``num_ppo_epochs`` passes over the batch, each in ``num_mini_batches`` mini-batches of whole groups, one
  optimizer step each.

TRL 1.16 no longer ships PPO (PPOTrainer and its ``masked_whiten`` were removed), so tests/test_ppo.py checks GAE,
whitening and the value loss against hand-computed values and a float64 reference written from the papers.
"""

from __future__ import annotations

import torch

from localrl.config import TrainConfig
from localrl.generation.rollout import Rollout
from localrl.policy.losses import kl_k3, masked_mean
from localrl.policy.grpo import row_slices
from localrl.policy.reference import Reference
from localrl.policy.shared_prompt import ConcatForward, SharedPromptForward


class Critic(torch.nn.Module):
    """The value head: hidden state [.., d] -> value [.., 1], zero-initialised."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def token_rewards(scores: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, mask: torch.Tensor,
                  kl_coef: float, estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """([N, R] per-token rewards, [N, R] per-token KL): ``-kl_coef * kl`` on every trained token, plus each row's
    ``scores`` on its last trained token (a row with none gets nothing)."""
    mask = mask.to(old_logp.dtype)
    if ref_logp is None:
        kl = torch.zeros_like(old_logp)
    elif estimator == "k1":
        kl = old_logp - ref_logp
    else:
        kl = kl_k3(old_logp, ref_logp)
    rewards = -kl_coef * kl * mask
    positions = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, -1).max(dim=1).values  # [N]
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] += scores.to(rewards.dtype)[rows]
    return rewards, kl * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's trained tokens (``mask``), backwards: delta_t = r_t +
    gamma * V_next - V_t and A_t = delta_t + gamma * lam * A_next, where "next" is the row's next trained token
    (0 after the last). Untrained positions get advantage 0 and are skipped. Returns (advantages, returns =
    advantages + values), both [N, R] and 0 off the mask."""
    n, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(n, dtype=rewards.dtype, device=rewards.device)
    next_advantage = torch.zeros_like(next_value)
    m = mask.bool()
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        here = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(m[:, t], here, torch.zeros_like(here))
        next_value = torch.where(m[:, t], values[:, t], next_value)
        next_advantage = torch.where(m[:, t], here, next_advantage)
    return advantages, (advantages + values) * m


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``x`` shifted to mean 0 and scaled to (unbiased) variance 1 over the positions ``mask`` holds; 0 elsewhere."""
    m = mask.to(x.dtype)
    count = m.sum()
    mean = (x * m).sum() / count.clamp(min=1)
    var = (((x - mean) * m) ** 2).sum() / (count - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * m


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over ``mask`` of 0.5 max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2), the share of those tokens
    where the clipped term is the larger). The sum, so micro-batches add up to the mini-batch's."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    plain, limited = (values - returns) ** 2, (clipped - returns) ** 2
    m = mask.to(values.dtype)
    return 0.5 * (torch.maximum(plain, limited) * m).sum(), masked_mean((limited > plain).to(values.dtype), m)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over ``mask`` of the clipped surrogate max(-A r, -A clip(r, 1 - low, 1 + high)), the clipped share)."""
    ratio = torch.exp(logp - old_logp)
    plain, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - low, 1 + high)
    m = mask.to(logp.dtype)
    return (torch.maximum(plain, clipped) * m).sum(), masked_mean((clipped > plain).to(logp.dtype), m)


def ppo_update(model, critic: Critic, optimizer, critic_optimizer, rollout: Rollout, scores: torch.Tensor,
               cfg: TrainConfig, micro_batch: int = 0, logits_chunk: int = 1024,
               reference: Reference | None = None) -> dict:
    """One PPO step on a finished rollout whose rows scored ``scores`` ([N]): the old log-probabilities and values
    and the reference's log-probabilities, per-token rewards, GAE, whitened advantages, then ``num_ppo_epochs`` x
    ``num_mini_batches`` optimizer steps of the policy and the critic together. Returns the step's statistics."""
    device = next(model.parameters()).device
    forward = SharedPromptForward if cfg.prompt_cache else ConcatForward
    n_rows = rollout.completion_ids.size(0)
    mask = rollout.trained_mask.to(device).float()
    chunks = row_slices(n_rows, micro_batch)

    with torch.no_grad():
        with forward(model, rollout, cfg.temperature, logits_chunk) as fwd:
            pairs = [fwd.logprobs(c, critic=critic) for c in chunks]
        old_logp = torch.cat([p[0] for p in pairs])
        old_values = torch.cat([p[1] for p in pairs]) * mask
        ref_logp = None
        if cfg.kl_coef > 0 or cfg.beta > 0:
            with (reference or Reference()).forward_context(model), \
                    forward(model, rollout, cfg.temperature, logits_chunk) as fwd:
                ref_logp = torch.cat([fwd.logprobs(c) for c in chunks])
        rewards, kl = token_rewards(scores.to(device), old_logp, ref_logp, mask, cfg.kl_coef, cfg.kl_estimator)
        advantages, returns = gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
        advantages = whiten(advantages, mask)

    params = [p for p in model.parameters() if p.requires_grad]
    groups = n_rows // rollout.group_size
    per_mini = -(-groups // cfg.num_mini_batches)
    totals = dict.fromkeys(("loss", "pg_loss", "vf_loss", "clip_frac", "vf_clip_frac"), 0.0)
    updates = 0
    for _ in range(cfg.num_ppo_epochs):
        for first in range(0, groups, per_mini):
            keep = torch.zeros(groups, dtype=torch.bool)
            keep[first:first + per_mini] = True
            rows = keep.repeat_interleave(rollout.group_size)
            mini = rollout.groups(keep)
            index = torch.nonzero(rows).squeeze(-1).to(device)
            m = mini.trained_mask.to(device).float()  # (the mini-batch's completions trimmed to its longest)
            width = m.size(1)
            tokens = m.sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            critic_optimizer.zero_grad(set_to_none=True)
            with forward(model, mini, cfg.temperature, logits_chunk) as fwd:
                for c in row_slices(index.numel(), micro_batch):
                    at = index[c]
                    logp, values = fwd.logprobs(c, critic=critic)
                    pg, clip_frac = policy_loss(logp, old_logp[at, :width], advantages[at, :width], m[c],
                                                cfg.epsilon, cfg.epsilon_high or cfg.epsilon)
                    vf, vf_clip = value_loss(values, old_values[at, :width], returns[at, :width], m[c],
                                             cfg.cliprange_value)
                    loss = (pg + cfg.vf_coef * vf) / tokens
                    if cfg.beta > 0:
                        loss = loss + cfg.beta * (kl_k3(logp, ref_logp[at, :width]) * m[c]).sum() / tokens
                    loss.backward()
                    share = m[c].sum().item() / tokens.item()
                    totals["pg_loss"] += pg.item() / tokens.item()
                    totals["vf_loss"] += vf.item() / tokens.item()
                    totals["loss"] += loss.item()
                    totals["clip_frac"] += clip_frac.item() * share
                    totals["vf_clip_frac"] += vf_clip.item() * share
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params + list(critic.parameters()), cfg.max_grad_norm)
            optimizer.step()
            critic_optimizer.step()
            updates += 1
    stats = {k: v / max(updates, 1) for k, v in totals.items()}
    trained = mask.sum().clamp(min=1)
    stats.update(kl=(kl.sum() / trained).item() if ref_logp is not None else None,
                 value_mean=(old_values.sum() / trained).item(), return_mean=(returns.sum() / trained).item())
    return stats
