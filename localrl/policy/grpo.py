"""The policy update of one GRPO step on a finished rollout: ``update`` (group advantages, the memory plan
for this batch) then ``policy_update`` (the clipped loss + KL to the reference, micro-batched through the
shared-prompt forward, ``num_iterations`` optimizer steps). The step itself, sampling included, is the
``grpo`` objective's (``localrl.objectives.grpo``).

Single-turn and multi-turn steps both end here: a rollout's ``trained_mask`` says which
completion tokens the loss covers (a multi-turn trajectory's environment tokens are attended
to but not trained on).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch

from localrl.config import TrainConfig
from localrl.distributed import world
from localrl.errors import UserError
from localrl.generation.rollout import Rollout
from localrl.policy.contrastive import (Contrast, contrast_labels, contrasted_groups, score_coefficients,
                                        sequence_scores)
from localrl.policy.losses import (LossSettings, flat_group_share, group_advantages, grpo_loss, high_entropy_mask,
                                   high_entropy_threshold, importance_weights, loss_normalizer, masked_mean)
from localrl.policy.reference import Reference
from localrl.policy.shared_prompt import ConcatForward, SharedPromptForward, enable_checkpointing


def update(model, optimizer, rollout: Rollout, rewards: torch.Tensor, cfg: TrainConfig, step: int, budget=None,
           sampler_logp: torch.Tensor | None = None, reference: Reference | None = None,
           entropy_coef: float | None = None, reward_rows: torch.Tensor | None = None,
           max_len: int | None = None, advantages: torch.Tensor | None = None, contrast: Contrast | None = None
           ) -> dict:
    """From a scored rollout ([B*G] float64 ``rewards``) to an updated adapter: group advantages (cut-off
    completions then leave the loss with ``mask_truncated_completions``), the memory
    plan re-made for this batch's real lengths (a batch that cannot fit is refused before it runs), then
    ``policy_update``. Returns policy_update's statistics plus what every step record reports about the update.
    ``reward_rows``: for a rollout whose rows are not the rewarded completions themselves (Markovian
    chunks), the reward each row takes its advantage from; ``max_len``: the longest a row can be (dr_grpo's
    constant; default ``max_new_tokens``); ``advantages``: [N] advantages of each row or [N, R] of each token,
    computed by the caller (a prefix tree's, turn-level credit's; one process), instead of one per completion from
    its group; ``contrast``: the contrastive term's settings this step (``localrl.policy.contrastive``), or none."""
    w = world()
    # of the global batch (each rank's groups, in rank order): scale_rewards = "batch" and the statistics
    everyone = w.gather(rewards.tolist())
    all_rewards = torch.tensor(sum(everyone, []), dtype=rewards.dtype)
    offset = sum(map(len, everyone[:w.rank]))
    if advantages is None:
        advantages = group_advantages(all_rewards, cfg.group_size, cfg.scale_rewards).float()
        advantages = advantages[offset:offset + rewards.numel()]
        if reward_rows is not None:
            advantages = advantages[reward_rows]
    else:
        advantages = advantages.float()
    flat_groups = flat_group_share(all_rewards, cfg.group_size)
    if cfg.mask_truncated_completions:  # cut-off completions still shaped their group's advantages above
        rollout = replace(rollout, loss_mask=rollout.trained_mask * (~rollout.truncated)[:, None].long())
    model.train()
    micro_batch, logits_chunk = batch_plan(model, rollout, cfg, step, budget)
    stats = policy_update(model, optimizer, rollout, advantages, cfg, micro_batch, logits_chunk, sampler_logp, reference,
                          entropy_coef, max_len, contrast)
    # groups whose completions all scored alike: nothing to learn
    return {**stats, "frac_reward_zero_std": flat_groups, "micro_batch": micro_batch or rollout.completion_ids.size(0)}


def batch_plan(model, rollout: Rollout, cfg: TrainConfig, step: int, budget=None) -> tuple[int, int]:
    """(micro-batch, logits chunk) of this batch's update: ``micro_batch_size`` without a budget, else the
    budget's plan for the batch's real lengths (turning on checkpointing where it says so); a batch that
    cannot fit is refused before anything runs."""
    if budget is None:
        return cfg.micro_batch_size, 1024
    prompt_len, completion_len = rollout.prompt_ids.size(1), rollout.completion_ids.size(1)
    plan = budget.plan(prompt_len, completion_len)
    if not plan.fits:
        raise UserError(f"step {step + 1}: predicted peak {plan.peak_bytes / 2**30:.2f} GiB exceeds "
                        f"memory_budget {cfg.memory_budget} (prompt {prompt_len} tokens, completions of up to "
                        f"{completion_len})")
    if plan.checkpointing:
        enable_checkpointing(model)
    return plan.micro_batch, plan.logits_chunk


def row_slices(n: int, size: int) -> list[slice]:
    size = size or n
    if n == 0:
        return []
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def policy_update(model, optimizer, rollout: Rollout, advantages: torch.Tensor, cfg: TrainConfig,
              micro_batch: int = 0, logits_chunk: int = 1024, sampler_logp: torch.Tensor | None = None,
              reference: Reference | None = None, entropy_coef: float | None = None, max_len: int | None = None,
              contrast: Contrast | None = None) -> dict:
    """The policy update of one step on a finished rollout, ``micro_batch`` completions at a time (0: all).
    ``sampler_logp`` ([N, R]): the log-probabilities of another sampler (llama.cpp), for importance weights;
    ``reference``: the KL reference (default: the base); ``entropy_coef``: the bonus's coefficient this step
    (default ``cfg.entropy_coef``; ``EntropyControl`` decides it under adaptive control); ``max_len``: the
    longest a row can be, dr_grpo's constant (default ``cfg.max_new_tokens``); ``contrast``: the contrastive
    term's settings, whose exact gradient is added through each row's sequence score (``score_coefficients``)."""
    device = next(model.parameters()).device
    w = world()  # under torchrun: this rank's rows, and collectives that make the step the global batch's
    n, = w.sum(loss_normalizer(cfg.loss_type, rollout.trained_mask, max_len or cfg.max_new_tokens))  # whole batch
    settings = LossSettings.of(cfg)
    forward = SharedPromptForward if cfg.prompt_cache else ConcatForward
    coef = cfg.entropy_coef if entropy_coef is None else entropy_coef
    bonus = coef != 0 or cfg.use_adaptive_entropy  # entropies are measured even while the coefficient is 0
    select_tokens = cfg.top_entropy_quantile < 1
    with_entropy = select_tokens or bonus
    full = rollout  # the high-entropy threshold is of every completion token of the step

    if cfg.beta == 0 and not bonus:
        # Without a KL term, a completion with zero advantage (every one of a group that scored alike)
        # adds exactly nothing to the loss or its gradient: only the other groups are computed. With none
        # left the gradient is zero, and an optimizer step would still move the adapter along Adam's
        # momentum (seen to collapse a real model's answers over a few such steps): nothing is updated.
        kept = without_flat_groups(rollout, advantages, sampler_logp)
        if kept is None:
            return {"loss": 0.0, "kl": None, "clip_frac": 0.0, **({} if contrast is None else {"contrastive": 0.0})}
        rollout, advantages, sampler_logp = kept
    trained = rollout.completion_ids.size(0)
    chunks = row_slices(trained, micro_batch)
    mask = rollout.trained_mask.to(device)  # the tokens the loss covers (the model's own, in a multi-turn rollout)
    adv = advantages.to(device)

    def frozen_logprobs(context) -> list[torch.Tensor]:
        if not chunks:
            return []
        with torch.no_grad(), context, forward(model, rollout, cfg.temperature, logits_chunk) as fwd:
            return [fwd.logprobs(c) for c in chunks]

    ref = frozen_logprobs((reference or Reference()).forward_context(model)) if cfg.beta > 0 else None
    old = frozen_logprobs(nullcontext()) if cfg.num_iterations > 1 else None
    totals = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0}
    if contrast is not None:
        labels = contrast_labels(adv, mask)
        groups, = w.sum(int(contrasted_groups(labels, rollout.group_size).sum()))
        totals["contrastive"] = 0.0

    def score_weights(iteration: int) -> torch.Tensor | None:
        """Each row's multiplier of its sequence score in this iteration's loss (the contrastive term's
        gradient at the current weights: the rollout's own log-probabilities in the first iteration)."""
        if contrast is None or not chunks:
            return None
        current = old if iteration == 0 and old is not None else frozen_logprobs(nullcontext())
        scores = torch.cat([sequence_scores(lp, mask[c]) for lp, c in zip(current, chunks)])
        weights, value = score_coefficients(scores, labels, rollout.group_size, contrast, groups)
        totals["contrastive"] += value / cfg.num_iterations
        return weights
    correct = sampler_logp is not None and cfg.rollout_is != "none"
    if correct:
        sampler_logp = sampler_logp.to(device)
        totals["is_weight"] = 0.0
    if with_entropy:
        totals["entropy"] = 0.0
    params = [p for p in model.parameters() if p.requires_grad]
    allreduce_s = 0.0
    for iteration in range(cfg.num_iterations):
        threshold, entropy_tokens = (entropy_selection(model, full, forward, cfg, micro_batch, logits_chunk)
                                     if with_entropy else (None, 1))
        weights = score_weights(iteration)
        optimizer.zero_grad(set_to_none=True)
        # leaving the forward's context finishes the prompt backward
        with forward(model, rollout, cfg.temperature, logits_chunk) if chunks else nullcontext() as fwd:
            for i, c in enumerate(chunks):
                logp, entropy = fwd.logprobs(c, with_entropy=True) if with_entropy else (fwd.logprobs(c), None)
                old_logp = old[i] if old is not None else logp.detach()
                is_weights = importance_weights(old_logp, sampler_logp[c], mask[c], cfg.rollout_is,
                                                cfg.rollout_is_cap) if correct else None
                selected = high_entropy_mask(entropy, mask[c], threshold) if select_tokens else None
                loss, stats = grpo_loss(logp, old_logp, adv[c], mask[c], settings,
                                        ref[i] if ref is not None else None, is_weights, selected,
                                        sampler_logp[c] if sampler_logp is not None else None)
                total = loss / n
                if with_entropy:  # the bonus is the mean entropy of the tokens the policy term acts on
                    acted = mask[c] if selected is None else mask[c] * selected
                    entropy_sum = (entropy * acted).sum()
                    total = total - coef * entropy_sum / entropy_tokens
                    totals["entropy"] += entropy_sum.item() / entropy_tokens / cfg.num_iterations
                if weights is not None:  # the contrastive term's gradient, through the chain rule
                    total = total + (weights[c] * sequence_scores(logp, mask[c])).sum()
                total.backward()
                weight = (c.stop - c.start) / trained / cfg.num_iterations  # statistics: of the rows computed
                if correct:  # the mean weight, over rows (sequence modes) or tokens
                    totals["is_weight"] += (is_weights.mean().item() if is_weights.size(-1) == 1
                                            else masked_mean(is_weights, mask[c]).item()) * weight
                totals["loss"] += loss.item() / n / cfg.num_iterations
                totals["kl"] += stats.get("kl", 0.0) * weight
                totals["clip_frac"] += stats["clip_frac"] * weight
        allreduce_s += w.all_reduce_gradients(params)
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
    if w.distributed:  # the global batch's statistics: sums (already over the global normaliser) and row means
        keys = list(totals)
        per_row = {"kl", "clip_frac", "is_weight"}
        sums = w.sum(*(totals[k] * (trained if k in per_row else 1) for k in keys), trained)
        totals = {k: v / max(sums[-1], 1) if k in per_row else v for k, v in zip(keys, sums)}
        totals["allreduce_s"] = round(allreduce_s, 4)
    if cfg.beta == 0:
        totals["kl"] = None
    return totals


def without_flat_groups(rollout: Rollout, advantages: torch.Tensor, sampler_logp: torch.Tensor | None
                        ) -> tuple[Rollout, torch.Tensor, torch.Tensor | None] | None:
    """The rollout, advantages and sampler log-probabilities without the groups whose advantages are all zero
    (each completion's trimmed to the longest kept), or None when no rank has a group left to learn from."""
    w = world()
    per_row = advantages if advantages.dim() == 1 else advantages.abs().amax(dim=-1)
    keep = per_row.view(-1, rollout.group_size).ne(0).any(dim=1)
    if not w.any(bool(keep.any())):
        return None
    if not keep.any():  # (distributed: other ranks have groups to learn from; this one adds zeros)
        return rollout.groups(keep), advantages[:0], sampler_logp
    if keep.all():
        return rollout, advantages, sampler_logp
    rows = keep.repeat_interleave(rollout.group_size)
    rollout, advantages = rollout.groups(keep), advantages[rows]
    if advantages.dim() == 2:  # (the kept completions are trimmed to their longest)
        advantages = advantages[:, :rollout.completion_ids.size(1)]
    if sampler_logp is not None:
        sampler_logp = sampler_logp[rows, :rollout.completion_ids.size(1)]
    return rollout, advantages, sampler_logp


def entropy_selection(model, rollout: Rollout, forward, cfg: TrainConfig, micro_batch: int, logits_chunk: int
                      ) -> tuple[torch.Tensor | None, int]:
    """This pass's high-entropy threshold over every completion token of the step, every rank's (None when
    top_entropy_quantile keeps them all), and the count of tokens the entropy bonus averages over."""
    w = world()
    device = next(model.parameters()).device
    whole_mask = rollout.trained_mask.to(device)
    if cfg.top_entropy_quantile >= 1:
        return None, max(w.sum(whole_mask.sum().item())[0], 1)
    with torch.no_grad(), forward(model, rollout, cfg.temperature, logits_chunk) as fwd:
        entropies = torch.cat([fwd.logprobs(c, with_entropy=True)[1]
                               for c in row_slices(rollout.completion_ids.size(0), micro_batch)])
    if w.distributed:  # the quantile of every rank's tokens
        values = torch.tensor(sum(w.gather(entropies[whole_mask.bool()].tolist()), []), device=device)
        threshold = high_entropy_threshold(values, torch.ones_like(values), cfg.top_entropy_quantile)
    else:
        threshold = high_entropy_threshold(entropies, whole_mask, cfg.top_entropy_quantile)
    selected = high_entropy_mask(entropies, whole_mask, threshold).sum().item()
    return threshold, max(w.sum(selected)[0], 1)
