"""A decoding cache that writes each new token's keys and values into room reserved once.

transformers' ``DynamicLayer`` grows by ``torch.cat``: every decoded token copies the whole
cache of every layer into a fresh tensor, O(L) work a token and, for a cache of 1 MiB or more,
fresh pages from the C library (localrl/heap.py fixes its mmap threshold at 1 MiB, so each such
tensor is mapped, zeroed by the kernel and unmapped again). Decoding a group of 8 completions of
100 tokens after a 1,000-token prompt copied 3.6 GB that way at the benchmark's shape.

``reserve_room(cache, tokens)``, after the prefill, moves each layer's keys and values into
buffers with room for ``tokens`` more positions; ``update`` then writes the new positions in
place and hands attention a view of the filled part. The values attention sees are the same
tensors' values as before (a test checks the logits match), only their storage differs.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class ReservedLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values are views into buffers with room to grow."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int, repeats: int = 1):
        super().__init__()
        self.device = keys.device
        self.is_initialized = True
        self._room = room
        self._hold(keys, values, repeats)

    def _hold(self, keys: torch.Tensor, values: torch.Tensor, repeats: int = 1) -> None:
        """Copy ``keys`` and ``values``, each batch row ``repeats`` times in a row (as ``repeat_interleave``),
        into fresh buffers with ``_room`` free positions after them: one copy, not one for each."""
        b, n = keys.shape[0], keys.shape[-2]
        self._k = keys.new_empty(b * repeats, *keys.shape[1:-2], n + self._room, keys.shape[-1])
        self._v = values.new_empty(b * repeats, *values.shape[1:-2], n + self._room, values.shape[-1])
        self._k.unflatten(0, (b, repeats))[..., :n, :] = keys[:, None]
        self._v.unflatten(0, (b, repeats))[..., :n, :] = values[:, None]
        self.keys, self.values = self._k[..., :n, :], self._v[..., :n, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.keys.shape[-2]
        m = n + key_states.shape[-2]
        if m > self._k.shape[-2]:  # more tokens than reserved: room again, as much as the cache holds
            self._room = max(self._room, m)
            self._hold(self.keys, self.values)
        self._k[..., n:m, :] = key_states
        self._v[..., n:m, :] = value_states
        self.keys, self.values = self._k[..., :m, :], self._v[..., :m, :]
        return self.keys, self.values

    # The reshaping calls of a DynamicLayer replace keys and values: keep them in reserved buffers after
    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self._hold(self.keys, self.values)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self._hold(self.keys, self.values, repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._hold(self.keys, self.values)


def reserve_room(cache, tokens: int, repeats: int = 1) -> None:
    """Give each full-attention layer of a filled ``DynamicCache`` room for ``tokens`` more positions, each
    batch row repeated ``repeats`` times as ``batch_repeat_interleave`` does, in the same copy (other layer
    kinds, such as sliding windows, are only repeated)."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
            cache.layers[i] = ReservedLayer(layer.keys, layer.values, tokens, repeats)
        elif repeats > 1:
            layer.batch_repeat_interleave(repeats)
