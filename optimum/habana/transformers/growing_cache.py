"""A dynamic KV cache that appends in place: what a Gaudi model's generate() uses where transformers would build a
`DynamicCache`.

transformers' `DynamicLayer` appends a token with `torch.cat` of the layer's whole keys and values: every decode
step copies the entire cache once more (and allocates it anew), so a step's cost grows with the context twice, once
for that copy and once for the attention that reads it. `GrowingLayer` keeps its keys and values in storage with
room to spare and writes each new token into the next free slots; the attention gets a view of the filled slots
only (`keys`/`values`), so a step reads each cached key and value once, in the attention kernel. The storage grows
when it is full, by at least an eighth of its length and in whole blocks of `GROWTH_BLOCK` tokens (a copy per
growth, amortised to a constant per token), never past the length generate() will reach (prompt + max_new_tokens):
a generation that ends within one growth step of its prompt allocates once, at its prompt, and never copies.

Memory: what its tokens need plus at most one growth step (an eighth of the length, or one block), and, while one
layer grows, that layer's old storage. Layers other than full attention (sliding windows, chunked, linear) keep
transformers' own classes, whose size the window bounds.
"""

import math

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import DynamicCache, DynamicLayer


GROWTH_BLOCK = 256  # tokens: the unit of the storage's length
GROWTH_FRACTION = 8  # a growth adds at least 1/8 of the length: amortised, a constant number of copies per token


def grown_capacity(needed: int, max_length: int | None = None) -> int:
    """The storage length for a layer that must hold `needed` tokens: one growth step beyond, within `max_length`
    (the most tokens the generation will cache) when that is known and enough."""
    capacity = math.ceil((needed + max(needed // GROWTH_FRACTION, 1)) / GROWTH_BLOCK) * GROWTH_BLOCK
    if max_length is not None and max_length >= needed:
        capacity = min(capacity, max_length)
    return capacity


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose storage has room to spare; `keys`/`values` are views of its filled slots.

    Everything transformers does to a dynamic layer (crop for assisted decoding, beam search's reorder, batch
    selection, offloading, reset) works on the storage, so the views stay valid and no later append copies.
    """

    def __init__(self, max_length: int | None = None) -> None:
        super().__init__()
        self.max_length = max_length
        self.key_storage: torch.Tensor | None = None
        self.value_storage: torch.Tensor | None = None
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.length = 0
        self._adopt(key_states[:, :, :0], value_states[:, :, :0])
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self.keys is not self._key_view or self.values is not self._value_view:
            self._adopt(self.keys, self.values)  # replaced from outside: take it over as the storage
        new = key_states.shape[-2]
        end = self.length + new
        if end > self.key_storage.shape[-2]:
            self._reserve(end)
        self.key_storage[:, :, self.length : end].copy_(key_states)
        self.value_storage[:, :, self.length : end].copy_(value_states)
        self._set_length(end)
        return self.keys, self.values

    def reset(self) -> None:
        self.key_storage = self.value_storage = None
        self.length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            super().crop(tokens_to_remove)  # transformers' error for the legacy positive form
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._set_length(max(self.length - abs(tokens_to_remove), 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            self._select_rows(beam_idx.to(self.device))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self.key_storage = self.key_storage.repeat_interleave(repeats, dim=0)
            self.value_storage = self.value_storage.repeat_interleave(repeats, dim=0)
            self._set_length(self.length)

    def offload(self) -> None:
        if self.is_initialized:
            self.key_storage = self.key_storage.to("cpu", non_blocking=True)
            self.value_storage = self.value_storage.to("cpu", non_blocking=True)
            self._set_length(self.length)

    def prefetch(self) -> None:
        if self.is_initialized and self.key_storage.device != self.device:
            self.key_storage = self.key_storage.to(self.device, non_blocking=True)
            self.value_storage = self.value_storage.to(self.device, non_blocking=True)
            self._set_length(self.length)

    def _select_rows(self, rows: torch.Tensor) -> None:
        """Keep (and reorder) batch rows: one copy, into storage of the same capacity."""
        self.key_storage = self.key_storage.index_select(0, rows)
        self.value_storage = self.value_storage.index_select(0, rows)
        self._set_length(self.length)

    def _reserve(self, needed: int) -> None:
        """Grow the storage to hold `needed` tokens: one copy of the filled slots, then room for the next ones."""
        capacity = grown_capacity(needed, self.max_length)
        batch, heads, _, key_dim = self.key_storage.shape
        keys = self.key_storage.new_empty((batch, heads, capacity, key_dim))
        values = self.value_storage.new_empty((batch, heads, capacity, self.value_storage.shape[-1]))
        keys[:, :, : self.length] = self.keys
        values[:, :, : self.length] = self.values
        self.key_storage, self.value_storage = keys, values
        self._set_length(self.length)

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make `keys`/`values` (filled to their length) the storage; the next append grows it."""
        self.key_storage, self.value_storage = keys, values
        self._set_length(keys.shape[-2])

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys = self._key_view = self.key_storage[:, :, :length]
        self.values = self._value_view = self.value_storage[:, :, :length]


class GrowingCache(DynamicCache):
    """transformers' `DynamicCache` with `GrowingLayer`s for its full-attention layers; see the module docstring.

    `max_cache_len`: the most tokens a generation will cache (generate() knows it), so that storage never grows
    past it; None when unknown.
    """

    def __init__(self, config: PreTrainedConfig, max_cache_len: int | None = None) -> None:
        super().__init__(config=config)
        self.max_cache_len = max_cache_len
        self.layers = [GrowingLayer(max_cache_len) if type(layer) is DynamicLayer else layer for layer in self.layers]


__all__ = ["GROWTH_BLOCK", "GrowingCache", "GrowingLayer", "grown_capacity"]
