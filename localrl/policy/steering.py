"""Steering vectors: what a trained adapter adds to the base model's residual stream, as one vector per decoder
layer, added back to the frozen base at a few chosen positions, with no weight update (after Venhoff et al.,
"Base models know how to reason, thinking models learn when").

Fitting. The trained model (base + adapter) completes training prompts greedily; on those token sequences the
output of every decoder layer is read twice, with the adapter and without it. ``D_l``, the mean over the
selected positions of (with - without) after layer ``l``, is how far the adapter has moved the residual stream
by then; layer ``l``'s vector is the part of that it added, ``D_l - D_(l-1)``. Layer 0 gets none and layer 1
takes ``D_1`` whole: llama.cpp's control vectors start at layer 1, so the same vectors steer a GGUF.

Steering adds each layer's vector (times ``scale``) to that layer's output at the selected positions, while the
base decodes. A position is selected by the token fed there (so a decoder with per-token control, llama.cpp's,
can follow it), and always at the last prompt position, the first decision:
- ``learned``: the tokens after which the trained model's next-token distribution differs most from the base's
  (mean KL divergence on the fitting text), taken in that order until they cover ``share`` of its positions:
  a classifier on the base's input, fitted to where the training changed what the model does. The paper
  steers about 12% of positions, the default share.
- ``starts``: every token that ends a line or a sentence (a newline, or text ending in ``. ! ? ; :``):
  where natural text chooses its next step.
- ``all``: every position.
``SteeredModel.share`` says how many positions were steered. The positions a vector is fitted on are the
ones its selector steers.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

SELECTORS = ("learned", "starts", "all")
_ENDS = (".", "!", "?", ";", ":")


def boundary_ids(tok) -> torch.Tensor:
    """Token ids whose text ends a line or a sentence (the ``starts`` selector's tokens)."""
    ids = []
    for token_id in range(len(tok)):
        text = tok.decode([token_id])
        if "\n" in text or text.rstrip().endswith(_ENDS):
            ids.append(token_id)
    return torch.tensor(ids, dtype=torch.long)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's blocks (under any peft wrapping): the ModuleList named ``layers`` with one entry a layer."""
    n = model.config.num_hidden_layers
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith("layers") and len(module) == n:
            return module
    raise ValueError(f"no decoder layers found in {type(model).__name__}")


def _hidden(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def select(ids: torch.Tensor, prompt_len: int, tokens: torch.Tensor | None) -> torch.Tensor:
    """[B, T] bool: the positions of ``ids`` (prompts of ``prompt_len`` tokens, left-padded, then completions)
    steered: the last prompt position, and after it those fed one of ``tokens`` (every one for None)."""
    chosen = torch.zeros_like(ids, dtype=torch.bool)
    chosen[:, prompt_len - 1] = True
    after = ids[:, prompt_len:]
    chosen[:, prompt_len:] = True if tokens is None else torch.isin(after, tokens.to(ids.device))
    return chosen


@torch.no_grad()
def token_effects(model, ids: torch.Tensor, mask: torch.Tensor, prompt_len: int,
                  batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed KL divergence of the trained model's next-token distribution from the base's, positions) per token
    id fed, over the completion positions of ``ids`` and the last prompt position (``model``: a peft model)."""
    vocab = model.config.vocab_size
    kl, count = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
    for start in range(0, len(ids), batch):
        part, real = ids[start:start + batch], mask[start:start + batch]
        positions = (real.cumsum(-1) - 1).clamp(min=0)
        trained = model(input_ids=part, attention_mask=real, position_ids=positions).logits.float().log_softmax(-1)
        with model.disable_adapter():
            base = model(input_ids=part, attention_mask=real, position_ids=positions).logits.float().log_softmax(-1)
        each = (trained.exp() * (trained - base)).sum(-1)  # [B, T]
        where = select(part, prompt_len, None) & real.bool()
        fed = part[where].cpu()
        kl.index_add_(0, fed, each[where].double().cpu())
        count.index_add_(0, fed, torch.ones(len(fed), dtype=torch.float64))
    return kl, count


def learned_tokens(kl: torch.Tensor, count: torch.Tensor, share: float) -> torch.Tensor:
    """The token ids in order of their mean KL (``token_effects``), as many as cover ``share`` of the positions."""
    seen = count > 0
    order = torch.argsort(torch.where(seen, kl / count.clamp(min=1), -1.0), descending=True)[:int(seen.sum())]
    covered = count[order].cumsum(0) / count.sum()
    return order[:int((covered < share).sum()) + 1]


@dataclass
class SteeringVectors:
    vectors: torch.Tensor  # [layers, hidden]: row 0 is zero (llama.cpp steers from layer 1)
    selector: str
    tokens: torch.Tensor | None  # the token ids whose positions are steered (None: every position)
    positions: int  # positions they were fitted on

    @staticmethod
    @torch.no_grad()
    def fit(model, ids: torch.Tensor, mask: torch.Tensor, prompt_len: int, selector: str,
            tokens: torch.Tensor | None, batch: int = 8) -> SteeringVectors:
        """Vectors of ``model`` (a peft model: with its adapter, and without) on ``ids`` [B, T] (prompts of
        ``prompt_len``, then completions; ``mask``: real tokens), averaged over the positions ``select`` picks
        with ``tokens``; ``batch`` sequences a forward pass."""
        chosen = select(ids, prompt_len, tokens)
        layers = decoder_layers(model)
        outputs: list[torch.Tensor] = []
        handles = [layer.register_forward_hook(lambda m, a, out: outputs.append(_hidden(out).float()))
                   for layer in layers]
        n = len(layers)
        moved = torch.zeros(n, model.config.hidden_size)
        count = 0
        try:
            for start in range(0, len(ids), batch):
                part, real = ids[start:start + batch], mask[start:start + batch]
                weight = (chosen[start:start + batch] & real.bool()).float()[..., None]
                positions = (real.cumsum(-1) - 1).clamp(min=0)
                outputs.clear()
                model(input_ids=part, attention_mask=real, position_ids=positions)
                with model.disable_adapter():
                    model(input_ids=part, attention_mask=real, position_ids=positions)
                moved += torch.stack([((outputs[i] - outputs[n + i]) * weight).sum((0, 1)).cpu() for i in range(n)])
                count += int(weight.sum())
        finally:
            for h in handles:
                h.remove()
        moved /= max(count, 1)  # D_l: [layers, hidden]
        vectors = torch.zeros_like(moved)
        vectors[1:] = moved[1:] - moved[:-1]
        vectors[1] = moved[1]
        return SteeringVectors(vectors, selector, tokens, count)


class SteeredModel:
    """Adds ``vectors`` (times ``scale``) to the decoder layers' outputs of ``model`` while it decodes, at the
    positions the selector picks (``with steered.on(): ...``); counts the positions it steered."""

    def __init__(self, model: nn.Module, steering: SteeringVectors, scale: float = 1.0):
        self.model, self.steering, self.scale = model, steering, scale
        self.steered = self.seen = 0
        self._mask: torch.Tensor | None = None

    @property
    def share(self) -> float:
        return self.steered / max(self.seen, 1)

    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids.shape[1] > 1:  # a prefill: only its last position is a decision
            mask = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
            mask[:, -1] = True
        elif self.steering.tokens is None:
            mask = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
        else:
            mask = torch.isin(ids, self.steering.tokens.to(ids.device))
        self.steered += int(mask[:, -1].sum())
        self.seen += ids.shape[0]
        self._mask = mask[..., None]

    def _adder(self, layer: int):
        vector = self.steering.vectors[layer]

        def hook(module, args, output):
            h = _hidden(output)
            h = h + (self.scale * self._mask * vector.to(h.dtype))
            return (h, *output[1:]) if isinstance(output, tuple) else h
        return hook

    @contextmanager
    def on(self):
        handles = [self.model.register_forward_pre_hook(self._before, with_kwargs=True)]
        for i, layer in enumerate(decoder_layers(self.model)):
            if i > 0:
                handles.append(layer.register_forward_hook(self._adder(i)))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._mask = None
