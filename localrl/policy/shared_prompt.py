"""Completion log-probabilities for GRPO, with each shared prompt computed once per group.

A GRPO batch holds B prompts, each with G sampled completions. The naive training forward
concatenates prompt and completion for every row, so each prompt is computed G times. Here:

1. The prompt pass runs the B prompts once, with gradients, and keeps every layer's keys
   and values plus the last prompt position's hidden state (it predicts the first
   completion token).
2. Those tensors are cut from the graph as leaf tensors. Each micro-batch of completions
   attends over its prompt's leaf keys/values through a read-only cache, computes its
   token log-probs, and is backpropagated at once: gradients reach the adapter weights
   directly and accumulate on the leaves. A micro-batch's completions of one prompt are packed
   end to end at their real lengths, and the output head runs only on completion tokens, so
   padding to the batch's longest completion is never computed.
3. After the last micro-batch, the accumulated leaf gradients are pushed through the prompt
   pass in one backward call.

By the chain rule this gives exactly the gradients of the naive forward, while each
prompt's activations exist once and completion activations exist one micro-batch at a
time. Log-softmax runs over chunks of tokens, recomputed in backward, so the
[rows, tokens, vocab] logits tensor never exists.

A prefix tree (``Rollout.branch``) is the same computation one level deeper: each prompt is a trunk (the
prompt and a teacher's deepest prefix), computed once, and each row attends only to the trunk's tokens
before its branch point and starts from the hidden state there.

Gradient checkpointing uses the model's own per-layer checkpointing (non-reentrant); the
caches below are safe under recomputation because re-running a layer never changes them.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache, DynamicLayer

from localrl.generation.rollout import Rollout


class _RecordingLayer(DynamicLayer):
    """Prompt pass: keep this call's keys/values (replacing, so a recomputed layer stores the same)."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class _PrefixLayer(DynamicLayer):
    """Completion pass: attend over fixed prompt keys/values plus the current tokens; never grows."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.device, self.is_initialized = keys, values, keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def _causal_lm(model) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def split_model(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder backbone returning hidden states, output head) of a causal LM, PEFT-wrapped or not."""
    base = _causal_lm(model)
    return base.model, base.get_output_embeddings()


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    with_entropy: bool) -> torch.Tensor:
    logits = head(hidden).float() / temperature  # [t, V]: one chunk only
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp[:, None]
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return torch.stack([logp, entropy], dim=-1)


def token_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_tokens: int = 1024, with_entropy: bool = False):
    """log p(target) under ``head(hidden) / temperature``, chunk by chunk: [n, T] (and entropies [n, T]).

    hidden: [n, T, d]; targets: [n, T]. Under autograd each chunk is recomputed in backward,
    so at most one chunk of logits ([chunk_tokens, vocab]) is alive at a time.
    """
    n, t, d = hidden.shape
    flat_h, flat_t = hidden.reshape(n * t, d), targets.reshape(n * t)
    parts = []
    for i in range(0, n * t, chunk_tokens):
        args = (head, flat_h[i:i + chunk_tokens], flat_t[i:i + chunk_tokens], temperature, with_entropy)
        if torch.is_grad_enabled() and flat_h.requires_grad:
            parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(*args))
    out = torch.cat(parts).reshape(n, t, -1)  # [n, T, 1 or 2]
    return (out[..., 0], out[..., 1]) if with_entropy else out[..., 0]


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


class ConcatForward:
    """The reference path: prompt and completion concatenated per row (the prompt runs G times)."""

    def __init__(self, model, rollout: Rollout, temperature: float = 1.0, chunk_tokens: int = 1024):
        self.backbone, self.head = split_model(model)
        self.rollout, self.temperature, self.chunk_tokens = rollout, temperature, chunk_tokens
        self.device = next(model.parameters()).device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def logprobs(self, rows: slice, with_entropy: bool = False, critic: torch.nn.Module | None = None):
        """log p of ``rows``' completion tokens [n, R] (and their entropies); with a ``critic`` (a module from
        hidden states [.., d] to [.., 1]), also its values [n, R] at the same positions: the state before each
        token."""
        r = self.rollout
        c_ids = r.completion_ids[rows].to(self.device)  # [n, R]
        prompt_ids, prompt_mask = r.row_prompts(rows)
        ids = torch.cat([prompt_ids.to(self.device), c_ids[:, :-1]], dim=1)
        mask = torch.cat([prompt_mask, r.completion_mask[rows][:, :-1]], dim=1).to(self.device)
        hidden = self.backbone(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).last_hidden_state
        hidden = hidden[:, -c_ids.size(1):]  # [n, R, d]: the positions that predict completion tokens
        return self._from_hidden(hidden, c_ids, r.completion_mask[rows], with_entropy, critic)

    def _from_hidden(self, hidden: torch.Tensor, c_ids: torch.Tensor, c_mask: torch.Tensor, with_entropy: bool,
                     critic, width: int | None = None):
        """log-probs (entropies, critic values) [n, width] from ``hidden`` [n, T, d] at the completion's positions.
        The output head runs only where ``c_mask`` is 1; elsewhere (padding) the outputs are 0."""
        n, t = c_ids.shape
        width = width or t
        where = c_mask.to(hidden.device).bool().nonzero(as_tuple=True)
        if where[0].numel():
            out = token_logprobs(self.head, hidden[where][None], c_ids.to(hidden.device)[where][None],
                                 self.temperature, self.chunk_tokens, with_entropy)
            out = tuple(o.new_zeros(n, width).index_put(where, o[0]) for o in (out if with_entropy else (out,)))
        else:  # no completion token in these rows: zeros, still on the graph
            out = (hidden.new_zeros(n, width, dtype=torch.float32) + hidden.sum() * 0,) * (2 if with_entropy else 1)
        if critic is not None:
            values = critic(hidden.float()).squeeze(-1)
            out += (torch.nn.functional.pad(values, (0, width - t)),)
        return out if len(out) > 1 else out[0]


class SharedPromptForward(ConcatForward):
    """The prompt-cache path. Use as a context: backward each micro-batch's loss inside it; leaving it
    completes the backward through the prompt pass.

        with SharedPromptForward(model, rollout) as fwd:
            for rows in micro_batches:
                loss(fwd.logprobs(rows)).backward()
    """

    def __enter__(self):
        r = self.rollout
        ids, mask = r.prompt_ids.to(self.device), r.prompt_mask.to(self.device)
        cache = Cache(layers=[_RecordingLayer() for _ in range(self.backbone.config.num_hidden_layers)])
        out = self.backbone(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), cache=cache,
                            use_cache=True)
        self._mask = mask
        self._next_pos = mask.sum(-1)  # [B]: position of each prompt's first completion token
        self._outputs = [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]
        # the hidden state that predicts each row's first token: left padding puts every prompt's end in the last
        # column ([B, d]); a prefix tree's rows branch off their trunk anywhere ([B, P, d], every column kept)
        self._outputs.append(out.last_hidden_state if r.branch is not None else out.last_hidden_state[:, -1])
        self._grad = torch.is_grad_enabled()
        # Leaves: completion micro-batches backpropagate into these, not into the prompt graph.
        self._leaves = [t.detach().requires_grad_(self._grad) for t in self._outputs]
        return self

    def __exit__(self, exc_type, *exc):
        try:
            if exc_type is None and self._grad:
                pairs = [(o, l.grad) for o, l in zip(self._outputs, self._leaves) if l.grad is not None]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            self._outputs = self._leaves = None
        return False

    def logprobs(self, rows: slice, with_entropy: bool = False, critic: torch.nn.Module | None = None):
        r, g = self.rollout, self.rollout.group_size
        n_layers = (len(self._leaves) - 1) // 2
        keys, values, last = self._leaves[:n_layers], self._leaves[n_layers:-1], self._leaves[-1]
        row_ids = torch.arange(rows.start, rows.stop)
        prompt_of_row = row_ids // g
        c_ids = r.completion_ids[rows].to(self.device)  # [n, R]
        width = self._mask.size(1)
        if r.branch is None:  # every row continues its whole prompt
            cut = torch.full((len(row_ids),), width)
            next_pos = self._next_pos.cpu().index_select(0, prompt_of_row)
            first = last.index_select(0, prompt_of_row.to(self.device))[:, None]  # [n, 1, d]: predicts token 0
        else:  # a prefix tree: the row sees its trunk's columns before ``cut``, and continues from there
            next_pos = r.branch[rows]
            cut = width - self._next_pos.cpu().index_select(0, prompt_of_row) + next_pos
            first = last[prompt_of_row.to(self.device), (cut - 1).to(self.device)][:, None]
        c_mask = r.completion_mask[rows]  # [n, R]
        n, width_r = c_ids.shape
        # each row feeds its tokens up to its last live one (which is only predicted, not fed): padding
        # past a row's end is neither computed nor attended to
        fed = (c_mask * torch.arange(1, width_r + 1)).amax(-1).sub(1).clamp(min=0)  # [n]
        total = int(fed.sum())
        if total == 0:
            return self._from_hidden(first, c_ids[:, :1], c_mask[:, :1], with_entropy, critic, width_r)
        # Pack the micro-batch's completions of each prompt end to end in one sequence that attends
        # over that prompt's keys/values once: [prompts here, longest packing] tokens.
        prompts_here, count = torch.unique_consecutive(prompt_of_row, return_counts=True)
        entry = torch.repeat_interleave(torch.arange(len(prompts_here)), count)  # packed sequence of each row
        before = torch.cumsum(fed, 0) - fed  # tokens fed by the micro-batch's earlier rows
        start = before - before[torch.cumsum(count, 0) - count][entry]  # each row's first column in its entry
        q_len = int(torch.zeros(len(prompts_here), dtype=fed.dtype).index_add_(0, entry, fed).max())
        row = torch.repeat_interleave(torch.arange(n), fed)  # [total]: the row of each fed token
        offset = torch.arange(total) - before[row]  # its place in its completion
        at = (entry[row], start[row] + offset)  # its column in the packing
        shape = (len(prompts_here), q_len)
        ids = torch.full(shape, r.completion_ids[0, 0].item(), dtype=torch.long).index_put(
            at, r.completion_ids[rows][row, offset])  # (the rollout's own CPU copy, not the device's)
        live = torch.zeros(shape, dtype=torch.bool).index_put(at, c_mask[row, offset].bool())
        owner = torch.full(shape, -1).index_put(at, row)  # the row a column belongs to (-1: filler)
        place = torch.zeros(shape, dtype=torch.long).index_put(at, offset)
        positions = torch.zeros(shape, dtype=torch.long).index_put(at, next_pos[row] + offset)
        # the prompt columns each column sees (a filler column: the whole prompt, so no query is masked out)
        sees = torch.full(shape, width).index_put(at, cut[row])
        b = prompts_here.to(self.device)
        cache = Cache(layers=[_PrefixLayer(kk.index_select(0, b), vv.index_select(0, b))
                              for kk, vv in zip(keys, values)])
        causal = (owner[:, :, None] == owner[:, None, :]) & (place[:, :, None] >= place[:, None, :])
        own = causal & live[:, None, :]  # [entries, q, q]: earlier live tokens of the same completion
        seen = torch.arange(width)[None, None] < sees[:, :, None]  # [entries, q, P]
        prefix = self._mask.index_select(0, b).bool()[:, None, :] & seen.to(self.device)  # [entries, q, P]
        mask = torch.cat([prefix, own.to(self.device)], dim=-1)[:, None]  # [entries, 1, q, P + q]
        out = self.backbone(input_ids=ids.to(self.device), attention_mask=self._attention_mask(mask),
                            position_ids=positions.to(self.device), cache=cache, use_cache=True)
        packed = out.last_hidden_state[at[0].to(self.device), at[1].to(self.device)]  # [total, d]
        rest = packed.new_zeros(n, width_r - 1, packed.size(-1)).index_put(
            (row.to(self.device), offset.to(self.device)), packed)
        hidden = torch.cat([first, rest], dim=1)  # [n, R, d]
        return self._from_hidden(hidden, c_ids, c_mask, with_entropy, critic, width_r)

    def _attention_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """A 4D mask in the form the model's attention takes: boolean for SDPA, additive otherwise."""
        if self.backbone.config._attn_implementation == "sdpa":
            return allowed
        dtype = next(self.backbone.parameters()).dtype
        dtype = dtype if dtype.is_floating_point else torch.float32
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)


def enable_checkpointing(model) -> None:
    """Per-layer activation checkpointing that keeps the prompt cache working.

    transformers' checkpointing drops the cache in training mode, since a recomputed layer
    would append to it twice. The caches here never change on recompute, so layers may keep
    them; recomputation is non-reentrant, which also carries gradients into the recorded
    prompt keys/values. Calling it again is a no-op.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    base = _causal_lm(model)
    if getattr(base, "_cache_keeping_checkpoints", False):
        return
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in base.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module._can_checkpoint_with_cache = True
    base._cache_keeping_checkpoints = True
