"""Grouped sampling: each prompt is prefilled once, then its G completions are decoded from that cache.

A small, explicit decode loop instead of ``model.generate``: it prefills the left-padded
prompts once, repeats the key/value cache G times per prompt, and samples with
caller-owned ``torch.Generator``s so that a run is reproducible step by step (and on
resume). With one generator per prompt, a group's completions do not depend on which other
prompts share its batch (or its rank, in a distributed run). Temperature 0 means greedy decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from localrl.generation.reserved_cache import reserve_room
from localrl.heap import reusing_heap


@dataclass
class Rollout:
    """Completions for ``B`` prompts x ``G`` samples, in prompt-major order (row = b * G + g)."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [B*G, R] right-padded
    completion_mask: torch.Tensor  # [B*G, R] 1 on generated tokens up to and including the stop token
    truncated: torch.Tensor  # [B*G] True where no stop token came before max_new_tokens
    group_size: int
    # [B*G, R] 1 on the tokens the loss covers, where that is not every completion token: a multi-turn
    # trajectory interleaves the model's turns with the environment's (tool outputs, template), which
    # the model attends to but did not sample
    loss_mask: torch.Tensor | None = None
    # [B*G] a prefix tree's rows (samplers/prefix_tree.py): each prompt is a trunk (the prompt and a teacher's
    # deepest prefix) and each row continues only its first ``branch[row]`` real tokens
    branch: torch.Tensor | None = None

    @property
    def trained_mask(self) -> torch.Tensor:
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    def row_prompts(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt each of ``rows`` continues, left-padded ([n, P] ids and mask): its group's prompt, or in a
        prefix tree the trunk's first ``branch`` tokens, moved to the right end."""
        index = torch.arange(rows.start, rows.stop) // self.group_size
        ids, mask = self.prompt_ids[index], self.prompt_mask[index]
        if self.branch is None:
            return ids, mask
        width = ids.size(1)
        source = torch.arange(width)[None] - (mask.sum(-1) - self.branch[rows])[:, None]  # column read from
        kept = source >= 0
        source = source.clamp(min=0)
        return ids.gather(1, source), mask.gather(1, source) * kept

    def groups(self, keep: torch.Tensor) -> "Rollout":
        """The prompts where ``keep`` ([B] bool) is set, with their groups; completions trimmed to the
        longest one kept."""
        return self.take(keep, keep.repeat_interleave(self.group_size), self.group_size)

    def take(self, prompts: torch.Tensor, rows: torch.Tensor, group_size: int) -> "Rollout":
        """A rollout of the prompts ``prompts`` selects and the completion rows ``rows`` selects (a bool mask or
        indices each), ``group_size`` rows for each prompt kept, in order; completions trimmed to the longest one
        kept."""
        mask = self.completion_mask[rows]
        width = max(int(mask.sum(-1).max()), 1) if mask.numel() else 1
        return Rollout(self.prompt_ids[prompts], self.prompt_mask[prompts], self.completion_ids[rows, :width],
                       mask[:, :width], self.truncated[rows], group_size,
                       None if self.loss_mask is None else self.loss_mask[rows, :width],
                       None if self.branch is None else self.branch[rows])


def concat_rollouts(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """Rollouts of one group size as one, in order: prompts left-padded and completions right-padded to the
    widest."""
    import torch.nn.functional as F

    p = max(r.prompt_ids.size(1) for r in rollouts)
    w = max(r.completion_ids.size(1) for r in rollouts)
    left = lambda t, value: F.pad(t, (p - t.size(1), 0), value=value)  # noqa: E731
    right = lambda t, value: F.pad(t, (0, w - t.size(1)), value=value)  # noqa: E731
    losses = None if all(r.loss_mask is None for r in rollouts) else [right(r.trained_mask, 0) for r in rollouts]
    branches = None if all(r.branch is None for r in rollouts) else [
        r.branch if r.branch is not None else r.prompt_mask.sum(-1).repeat_interleave(r.group_size) for r in rollouts]
    return Rollout(torch.cat([left(r.prompt_ids, pad_id) for r in rollouts]),
                   torch.cat([left(r.prompt_mask, 0) for r in rollouts]),
                   torch.cat([right(r.completion_ids, pad_id) for r in rollouts]),
                   torch.cat([right(r.completion_mask, 0) for r in rollouts]),
                   torch.cat([r.truncated for r in rollouts]), rollouts[0].group_size,
                   None if losses is None else torch.cat(losses), None if branches is None else torch.cat(branches))


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack variable-length sequences with padding on the left; returns ids and mask."""
    n = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (n - len(s)) + list(s) for s in seqs], dtype=torch.long)
    mask = torch.tensor([[0] * (n - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack variable-length sequences with padding on the right; returns ids and mask."""
    n = max(len(s) for s in seqs)
    ids = torch.tensor([list(s) + [pad_id] * (n - len(s)) for s in seqs], dtype=torch.long)
    mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs], dtype=torch.long)
    return ids, mask


def group_generators(seed: int, indices, device) -> list[torch.Generator]:
    """One sampling generator per group, seeded by (``seed``, the group's index in the step's global batch),
    so a group's samples do not depend on which other groups share its batch, process or round."""
    return [torch.Generator(device=device).manual_seed((seed * 1_000_033 + i) % 2**63) for i in indices]


def sample_in_chunks(model, prompts: list[list[int]], group_size: int, max_new_tokens: int, stop_ids: list[int],
                     pad_id: int, temperature: float, generators: list[torch.Generator] | None, at_once: int
                     ) -> Rollout:
    """``sample_groups`` over ``at_once`` prompts at a time (as many as a memory budget holds), as one rollout;
    each group draws from its own generator (or decodes greedily: ``temperature`` 0, no generators), so the
    completions are those of sampling all prompts at once."""
    return concat_rollouts([sample_groups(model, prompts[i:i + at_once], group_size, max_new_tokens, stop_ids,
                                          pad_id, temperature, generators[i:i + at_once] if generators else None)
                            for i in range(0, len(prompts), at_once)], pad_id)


@torch.no_grad()
def sample_groups(
    model,
    prompts: list[list[int]],
    group_size: int,
    max_new_tokens: int,
    stop_ids: list[int],
    pad_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | list[torch.Generator] | None = None,
    on_token: Callable[[float], None] | None = None,
) -> Rollout:
    """Sample ``group_size`` completions for every prompt (token-id lists); ``generator``: one for the batch,
    or one per prompt (its group's completions are drawn from it alone). ``on_token(share)``, after each
    decoded token: the share of the batch's decoding done (finished completions whole, the others by tokens
    of ``max_new_tokens``), for progress within a long batch."""
    with reusing_heap():  # decoding allocates the same sizes token after token: blocks reused, not mapped afresh
        return _sample_groups(model, prompts, group_size, max_new_tokens, stop_ids, pad_id, temperature, generator,
                              on_token)


def _sample_groups(model, prompts, group_size, max_new_tokens, stop_ids, pad_id, temperature, generator,
                   on_token) -> Rollout:
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    ids, mask = prompt_ids.to(device), prompt_mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P] real positions despite left padding
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=1)
    # One prefill per prompt, repeated for its group into room for the completions: each decoded token's
    # keys and values are written in place from here on, not copied with the whole cache
    reserve_room(cache, max_new_tokens - 1, repeats=group_size)
    logits = out.logits[:, -1].float().repeat_interleave(group_size, dim=0)  # [N, V]
    mask = mask.repeat_interleave(group_size, dim=0)
    next_pos = positions[:, -1:].repeat_interleave(group_size, dim=0) + 1  # [N, 1]
    n = logits.size(0)
    stop = torch.tensor(stop_ids, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    tokens, live = [], []
    for t in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            if isinstance(generator, list):
                tok = torch.cat([torch.multinomial(probs[b * group_size:(b + 1) * group_size], 1, generator=g)
                                 for b, g in enumerate(generator)]).squeeze(-1)
            else:
                tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            tok = logits.argmax(-1)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        live.append(~done)
        tokens.append(tok)
        done = done | torch.isin(tok, stop)
        if on_token is not None:
            finished = int(done.sum())
            on_token((finished + (n - finished) * (t + 1) / max_new_tokens) / n)
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                    cache=cache, use_cache=True)
        logits = out.logits[:, -1].float()
        next_pos = next_pos + 1
    completion_ids = torch.stack(tokens, dim=1).cpu()
    completion_mask = torch.stack(live, dim=1).long().cpu()
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, (~done).cpu(), group_size)


def encode_prompts(tok, rows: list[dict], system: str | None = None) -> list[list[int]]:
    """Token ids of each row's prompt, through the chat template when the tokenizer has one; with
    ``system``, a system message comes first (unless the row's messages bring their own)."""
    out = []
    for row in rows:
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if system and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}, *messages]
        if tok.chat_template:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            out.append(tok(text, add_special_tokens=False)["input_ids"])
        else:
            out.append(tok("\n".join(m["content"] for m in messages))["input_ids"])
    return out


def decode_completions(tok, rollout: Rollout) -> list[str]:
    """Completion texts without padding or special tokens (reasoning tags are kept)."""
    return [tok.decode(ids, skip_special_tokens=True) for ids in completion_token_ids(rollout)]


def completion_token_ids(rollout: Rollout) -> list[list[int]]:
    """Each completion's token ids without padding (its stop token included): the ``completion_ids``
    column rewards receive."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]


def stop_token_ids(tok, model) -> list[int]:
    """Tokens that end a completion: the tokenizer's eos and the model's generation eos ids."""
    ids = {tok.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)
