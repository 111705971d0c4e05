"""Markovian thinking (Delethink: Aghajohari et al., "The Markovian Thinker", 2025): reasoning in chunks of
C tokens whose context is rebuilt at each boundary, so it never grows with the length of the thought.

A trace starts from the query. Each chunk is sampled in its own context: the query for the first, the
query plus the last m tokens of the previous chunk (the carried state) for the others; a chunk ends
after C tokens or at a stop token, and the trace ends at a stop token or when it has used the trace's
budget (``max_new_tokens``). So no context is ever longer than query + C + m, however long the model
thinks. The reward reads the whole trace (every chunk's tokens in order).

For the update each chunk is one row: its context as the prompt, its tokens as the completion, the
trace's advantage as its advantage; every chunk's tokens are trained in exactly the context they were
sampled in. The rows go through the same ``policy_update`` (and prompt-cache forward) as ordinary
completions, each chunk weighted as one sequence by the loss type (``dr_grpo`` divides by C). The
sampler that does this in a run is ``localrl.samplers.markovian``.

Deliberate simplifications: each trace's chunks are prefilled afresh (no cache carried across a
boundary, which the rebuilt context forbids anyway), the torch sampler only, one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localrl.generation.rollout import Rollout, group_generators, left_pad, sample_groups


@dataclass
class Chunks:
    """The chunks of B x G traces. ``rollout`` has one row per chunk (group size 1), ordered trace by trace."""

    rollout: Rollout
    trace: torch.Tensor  # [rows] the trace (b * G + g) of each chunk
    index: torch.Tensor  # [rows] its position in the trace (0 for the first chunk)
    traces: list[list[int]]  # [B*G] every trace's tokens, chunk after chunk
    truncated: torch.Tensor  # [B*G] no stop token within the trace's budget


def chunk_context(query: list[int], previous: list[int] | None, carry: int) -> list[int]:
    """A chunk's context: the query, then the last ``carry`` tokens of the previous chunk (if any)."""
    return list(query) + (list(previous[-carry:]) if previous and carry else [])


@torch.no_grad()
def sample_markovian(model, prompts: list[list[int]], group_size: int, chunk: int, carry: int, max_tokens: int,
                     stop_ids: list[int], pad_id: int, temperature: float, seed: int) -> Chunks:
    """Sample ``group_size`` Markovian traces for each prompt; each trace draws from its own generator
    (seeded by ``seed`` and its index), so its tokens do not depend on the others'."""
    device = next(model.parameters()).device
    n = len(prompts) * group_size
    generators = group_generators(seed, range(n), device)
    traces: list[list[int]] = [[] for _ in range(n)]
    last: list[list[int] | None] = [None] * n
    stopped = [False] * n
    stops = set(stop_ids)
    contexts, pieces, owners, positions = [], [], [], []
    k = 0
    while True:
        active = [t for t in range(n) if not stopped[t] and len(traces[t]) < max_tokens]
        if not active:
            break
        ctx = [chunk_context(prompts[t // group_size], last[t], carry) for t in active]
        budget = min(chunk, max_tokens - k * chunk)
        out = sample_groups(model, ctx, 1, budget, stop_ids, pad_id, temperature, [generators[t] for t in active])
        for i, t in enumerate(active):
            tokens = out.completion_ids[i, :int(out.completion_mask[i].sum())].tolist()
            contexts.append(ctx[i])
            pieces.append(tokens)
            owners.append(t)
            positions.append(k)
            traces[t] += tokens
            last[t] = tokens
            stopped[t] = bool(tokens) and tokens[-1] in stops
        k += 1
    prompt_ids, prompt_mask = left_pad(contexts, pad_id)
    width = max(len(p) for p in pieces)
    completion_ids = torch.full((len(pieces), width), pad_id, dtype=torch.long)  # [rows, C] right-padded
    completion_mask = torch.zeros_like(completion_ids)
    for r, tokens in enumerate(pieces):
        completion_ids[r, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        completion_mask[r, :len(tokens)] = 1
    truncated = torch.tensor([not s for s in stopped])
    owner = torch.tensor(owners)
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated[owner], 1)
    return Chunks(rollout, owner, torch.tensor(positions), traces, truncated)


def trace_rollout(chunks: Chunks, prompts: list[list[int]], group_size: int, pad_id: int) -> Rollout:
    """The traces as an ordinary rollout (each whole trace one completion), for decoding and evaluation."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    width = max(max(len(t) for t in chunks.traces), 1)
    ids = torch.full((len(chunks.traces), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(chunks.traces):
        ids[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        mask[i, :len(t)] = 1
    return Rollout(prompt_ids, prompt_mask, ids, mask, chunks.truncated, group_size)
