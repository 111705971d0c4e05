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
  (1 - 2e), e = ``label_smoothing``, the assumed share of flipped labels;
- ``sft``: the chosen completions' negative log-likelihood, the mean over all their tokens in the batch.

The loss of a batch is the mean over its pairs. As in TRL, ``loss_type`` may name several, comma-separated, and
the loss is their sum weighted by ``loss_weights`` (1 each by default): ``sigmoid,sft`` is RPO (Pang et al. 2024),
DPO that also raises the chosen completion's own likelihood, so the policy's choice moves, not only its margin.
The implicit rewards TRL logs are beta x each log-ratio.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from localrl.config import TrainConfig
from localrl.generation.rollout import Rollout
from localrl.policy.grpo import row_slices
from localrl.policy.reference import Reference
from localrl.policy.shared_prompt import ConcatForward, SharedPromptForward


def loss_terms(loss_type: str, loss_weights: str = "") -> list[tuple[str, float]]:
    """(loss, weight) of each loss ``loss_type`` names (comma-separated), weighted by ``loss_weights`` (comma-separated
    numbers >= 0, one a loss; empty: 1 each). A ValueError says what is wrong with ``loss_weights`` (the config
    reports it as a one-line error before a run, ``DPO.check_settings``)."""
    names = [n.strip() for n in loss_type.split(",")]
    if not loss_weights.strip():
        return [(name, 1.0) for name in names]
    not_weights = ValueError("must be comma-separated numbers >= 0")
    try:
        weights = [float(w) for w in loss_weights.split(",")]
    except ValueError:
        raise not_weights from None
    if not all(w >= 0 and math.isfinite(w) for w in weights):
        raise not_weights
    if len(weights) != len(names):
        raise ValueError(f"must give one weight for each loss in loss_type ({len(names)}: {loss_type})")
    if not any(weights):
        raise ValueError("must weigh at least one loss above 0 (with every weight 0 nothing trains)")
    return list(zip(names, weights))


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None, loss_weights: str = "",
             sft_tokens: torch.Tensor | float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of B pairs ([B] summed log-probabilities each) and its statistics: the implicit rewards of the
    chosen and rejected completions, their margin, and the share of pairs whose chosen reward is the higher.
    ``chosen_tokens``/``rejected_tokens`` ([B] token counts) are needed by ``ipo`` and ``sft``; ``sft_tokens``: the
    chosen tokens ``sft`` averages over (default: these pairs'; a micro-batch passes its share of the batch's)."""
    total = 0.0
    for name, weight in loss_terms(loss_type, loss_weights):
        if name == "sft":
            if chosen_tokens is None and sft_tokens is None:
                raise ValueError("sft averages over the chosen completions' tokens: give their counts")
            count = max(float(chosen_tokens.sum()), 1.0) if sft_tokens is None else float(sft_tokens)
            loss = -chosen_logps.sum() / count
        else:
            loss = _pair_losses(chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps, beta, name,
                                label_smoothing, chosen_tokens, rejected_tokens).mean()
        total = total + weight * loss
    with torch.no_grad():
        reward_chosen = beta * (chosen_logps - ref_chosen_logps)
        reward_rejected = beta * (rejected_logps - ref_rejected_logps)
        stats = {"reward_chosen": reward_chosen.mean().item(), "reward_rejected": reward_rejected.mean().item(),
                 "reward_margin": (reward_chosen - reward_rejected).mean().item(),
                 "reward_accuracy": (reward_chosen > reward_rejected).double().mean().item()}
    return total, stats


# A pair loss: [B] the loss of each pair from its chosen and rejected log-ratios (policy less reference, summed over
# each completion's tokens); beta, and by keyword label_smoothing and the completions' [B] token counts
PairLoss = Callable[..., torch.Tensor]
PAIR_LOSSES: dict[str, PairLoss] = {}  # by TRL's name (``loss_type``), in the order registered


def pair_loss(name: str):
    """Register a DPO pair loss under ``name`` (a decorator), as ``losses.policy_loss`` registers a policy loss."""
    def register(fn: PairLoss) -> PairLoss:
        if name in PAIR_LOSSES:
            raise ValueError(f"DPO loss type {name} is registered twice")
        PAIR_LOSSES[name] = fn
        return fn
    return register


@pair_loss("sigmoid")
def _sigmoid(chosen, rejected, beta, **_) -> torch.Tensor:
    return -F.logsigmoid(beta * (chosen - rejected))


@pair_loss("ipo")
def _ipo(chosen, rejected, beta, chosen_tokens=None, rejected_tokens=None, **_) -> torch.Tensor:
    if chosen_tokens is None or rejected_tokens is None:
        raise ValueError("ipo normalises each log-ratio by its completion's length: give the token counts")
    per_token = chosen / chosen_tokens.clamp(min=1) - rejected / rejected_tokens.clamp(min=1)
    return (per_token - 1 / (2 * beta)) ** 2


@pair_loss("hinge")
def _hinge(chosen, rejected, beta, **_) -> torch.Tensor:
    return torch.relu(1 - beta * (chosen - rejected))


@pair_loss("robust")
def _robust(chosen, rejected, beta, label_smoothing=0.0, **_) -> torch.Tensor:
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"robust: label_smoothing must be in [0, 0.5) (got {label_smoothing})")
    margin = beta * (chosen - rejected)
    return (-(1 - label_smoothing) * F.logsigmoid(margin) + label_smoothing * F.logsigmoid(-margin)) / \
        (1 - 2 * label_smoothing)


DPO_LOSS_TYPES = (*PAIR_LOSSES, "sft")  # sft: the chosen completions' own likelihood, not a pair's


def _pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, loss_type: str, label_smoothing: float,
                 chosen_tokens: torch.Tensor | None, rejected_tokens: torch.Tensor | None) -> torch.Tensor:
    """[B] the loss of each pair by the registered pair loss ``loss_type``."""
    if loss_type not in PAIR_LOSSES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; use one of {', '.join(DPO_LOSS_TYPES)}")
    return PAIR_LOSSES[loss_type](chosen, rejected, beta, label_smoothing=label_smoothing,
                                  chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens)


def preference_pairs(rollout: Rollout, rewards: torch.Tensor) -> tuple[Rollout | None, int]:
    """Each group's best and worst completion by reward (the first of equals), as a rollout of groups of two (row
    2i chosen, 2i + 1 rejected): online DPO's pairs from GRPO's groups, and a preference file's pairs as they are.
    Groups whose rewards all tie teach no preference and are left out; returns (the pairs, None where no group is
    left, and the number of groups left out)."""
    g = rollout.group_size
    grouped = rewards.view(-1, g)
    keep = grouped.amax(1) > grouped.amin(1)
    tied = int((~keep).sum())
    if not keep.any():
        return None, tied
    first = torch.arange(grouped.size(0)) * g
    rows = torch.stack([first + grouped.argmax(1), first + grouped.argmin(1)], dim=1)[keep].flatten()
    return rollout.take(keep, rows, 2), tied


def _pair_chunks(rows: int, micro_batch: int) -> list[slice]:
    """Micro-batches of whole pairs: ``micro_batch`` rows rounded down to an even count, at least one pair."""
    return row_slices(rows, max(2, (micro_batch or rows) // 2 * 2))


def sequence_logps(model, pairs: Rollout, cfg: TrainConfig, micro_batch: int = 0, logits_chunk: int = 1024,
                   context=None) -> torch.Tensor:
    """[rows] each completion's summed log-probability of its trained tokens, without gradients, under ``context``
    (``Reference().forward_context(model)``: the reference's)."""
    device = next(model.parameters()).device
    mask = pairs.trained_mask.to(device)
    forward = SharedPromptForward if cfg.prompt_cache else ConcatForward
    with torch.no_grad(), context or nullcontext(), forward(model, pairs, 1.0, logits_chunk) as fwd:
        return torch.cat([(fwd.logprobs(c) * mask[c]).sum(-1)
                          for c in _pair_chunks(pairs.completion_ids.size(0), micro_batch)])


def dpo_update(model, optimizer, pairs: Rollout, cfg: TrainConfig, micro_batch: int = 0, logits_chunk: int = 1024,
               reference: Reference | None = None) -> dict:
    """One AdamW step on the DPO loss of ``pairs`` (``preference_pairs``' rollout): the reference's log-probabilities
    first (the base with the adapter off, or a synced reference's weights), then the policy's, a micro-batch of whole
    pairs at a time through the shared-prompt forward, each micro-batch's mean loss weighted by its share of the
    pairs (so the gradient is the whole batch's mean, for any micro-batch; ``sft`` over the batch's chosen tokens). Returns the loss and ``dpo_loss``'s
    statistics, of the whole batch."""
    device = next(model.parameters()).device
    reference = reference or Reference()
    rows = pairs.completion_ids.size(0)
    mask = pairs.trained_mask.to(device)
    tokens = mask.sum(-1)
    chunks = _pair_chunks(rows, micro_batch)
    model.train()
    ref = sequence_logps(model, pairs, cfg, micro_batch, logits_chunk, context=reference.forward_context(model))
    settings = dict(beta=cfg.beta, loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing,
                    loss_weights=cfg.loss_weights)
    chosen_tokens = max(float(tokens[0::2].sum()), 1.0)  # (clamped once, for the whole batch, as sft's default)
    optimizer.zero_grad(set_to_none=True)
    policy = []
    forward = SharedPromptForward if cfg.prompt_cache else ConcatForward
    with forward(model, pairs, 1.0, logits_chunk) as fwd:  # leaving it finishes the prompt backward
        for c in chunks:
            logp = (fwd.logprobs(c) * mask[c]).sum(-1)
            share = (c.stop - c.start) / rows
            loss, _ = dpo_loss(logp[0::2], logp[1::2], ref[c][0::2], ref[c][1::2], **settings,
                               chosen_tokens=tokens[c][0::2], rejected_tokens=tokens[c][1::2],
                               sft_tokens=chosen_tokens * share)
            (loss * share).backward()
            policy.append(logp.detach())
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    optimizer.step()
    policy = torch.cat(policy)
    loss, stats = dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2], **settings,
                           chosen_tokens=tokens[0::2], rejected_tokens=tokens[1::2])
    return {"loss": loss.item(), **stats}


def preference_accuracy(model, pairs: Rollout, cfg: TrainConfig, batch_size: int = 64) -> dict:
    """Held-out pairs as the run's evaluations report them: ``accuracy``, the share of pairs whose implicit reward
    (beta x the policy's log-ratio to the reference) ranks the chosen completion above the rejected (a tie counts
    half: before training every pair ties, 50%); ``reward_mean``, the mean implicit-reward margin;
    ``logp_accuracy``, the share whose chosen completion the policy itself gives the higher summed log-probability
    (what it would prefer, the reference aside); ``n``, the pairs."""
    was_training = model.training
    model.eval()
    policy = sequence_logps(model, pairs, cfg, batch_size)
    ref = sequence_logps(model, pairs, cfg, batch_size, context=Reference().forward_context(model))
    model.train(was_training)
    margin = cfg.beta * ((policy[0::2] - ref[0::2]) - (policy[1::2] - ref[1::2]))
    return {"accuracy": ((margin > 0).double() + 0.5 * (margin == 0).double()).mean().item(),
            "reward_mean": margin.mean().item(),
            "logp_accuracy": (policy[0::2] > policy[1::2]).double().mean().item(),
            "n": margin.numel()}
