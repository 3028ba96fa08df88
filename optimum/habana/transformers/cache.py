"""A static KV cache whose attended length grows in buckets: Optimum-Habana's `--bucket_size` and `--bucket_internal`.

A plain static cache makes every decode step attend over prompt + max_new_tokens slots from the first step on; most
of them are still empty. `BucketedStaticCache` keeps the shapes static per bucket of `bucket_size` tokens instead:
attention (both paths) reads the filled buckets only, and the mask is built for that length. With `preallocate`
(`--bucket_internal`) the full-length tensors are allocated once and sliced; without it they grow by one bucket
when the next token needs it. Either way a compiled decode step sees one shape per bucket, so `torch.compile`
builds one graph per bucket, not one per step.

The length is set outside the compiled region, before each forward, as a Python number (no device sync):
`GaudiAttentionMixin.prepare_inputs_for_generation` calls `prepare_for_new_tokens` in `generate()`; callers of
`forward` call it themselves. Sliding-window and chunked layers keep transformers' own fixed-size static layers,
which roll: a cache of those alone takes tokens past `max_cache_len`, as stock's does. Those branch on a Python count
inside the forward, which a replayed HPU graph never advances: with `full_length_windows` (Gaudi) they are
bucketed full-length layers too, their window or chunk applied by the layer's mask (Optimum-Habana's cache holds every
layer's whole length likewise).
"""

import math

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import (
    STATIC_LAYER_TYPE_MAPPING,
    StaticCache,
    StaticLayer,
    StaticSlidingWindowLayer,
    get_layer_types_and_kwargs,
)
from transformers.utils import is_torchdynamo_compiling


def static_cache_problem(config: PreTrainedConfig) -> str | None:
    """Why transformers builds no static cache for `config`'s model, in words that end a sentence; None where it
    does. DeepSeek V4's compressed-attention layers have no static layer kind: `StaticCache` fails with a KeyError."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    missing = sorted(set(layer_types) - set(STATIC_LAYER_TYPE_MAPPING))
    if not missing:
        return None
    kinds = ", ".join(repr(kind) for kind in missing)
    return f"transformers has no static KV cache for {config.model_type} models (no static layer for their {kinds} layers)"


def bucketed_length(tokens: int, bucket_size: int, max_cache_len: int) -> int:
    """The attended length once a cache holds `tokens` tokens: whole buckets, capped at `max_cache_len`."""
    return min(math.ceil(tokens / bucket_size) * bucket_size, max_cache_len)


class BucketedStaticLayer(StaticLayer):
    """A full-attention layer: static storage, attended length rounded up to a whole bucket."""

    def __init__(self, max_cache_len: int, bucket_size: int, preallocate: bool) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.bucket_size = bucket_size
        self.preallocate = preallocate
        self.active_length = min(bucket_size, max_cache_len)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if not self.preallocate:
            # Keep only the first bucket; `set_active_length` grows the storage.
            self._replace_storage(self.keys[:, :, : self.active_length], self.values[:, :, : self.active_length])

    def set_active_length(self, length: int) -> None:
        """Attend over `length` slots from the next forward on (a whole number of buckets, capped at the maximum)."""
        self.active_length = length
        if self.is_initialized and self.keys.shape[2] < length:
            grown = (self.batch_size, self.num_heads, length - self.keys.shape[2])
            keys = self.keys.new_zeros((*grown, self.k_head_dim))
            values = self.values.new_zeros((*grown, self.v_head_dim))
            self._replace_storage(torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2))

    def _replace_storage(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys.contiguous(), values.contiguous()
        if not is_torchdynamo_compiling():
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        return keys[:, :, : self.active_length], values[:, :, : self.active_length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.active_length, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.is_initialized:
            self._replace_storage(self.keys, self.values)


class BucketedStaticCache(StaticCache):
    """Static KV cache attended in buckets of `bucket_size` tokens; see the module docstring.

    A `StaticCache` as transformers builds it (the same layer kinds, each full-attention layer's storage the whole
    `max_cache_len`), its full-attention layers attended over their filled buckets only. Attention weights
    (`output_attentions`) therefore have the bucketed length as their last dimension, not the cache's: generate()
    builds one only where no weights are asked for. Reusable across `generate()` calls (Optimum-Habana's
    `--reuse_cache`): `reset()` empties it and keeps the storage.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        max_cache_len: int,
        bucket_size: int,
        preallocate: bool = True,
        full_length_windows: bool = False,
    ) -> None:
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be at least 1, got {bucket_size}.")
        super().__init__(config=config, max_cache_len=max_cache_len)
        bucketed = (StaticLayer, StaticSlidingWindowLayer) if full_length_windows else (StaticLayer,)
        self.layers = [
            BucketedStaticLayer(max_cache_len, bucket_size, preallocate) if type(layer) in bucketed else layer
            for layer in self.layers
        ]
        self.bucket_size = bucket_size
        self.max_cache_len = max_cache_len
        self.tokens = 0  # held after the current forward; a Python int, so that compiled code never reads a tensor

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """The cached length as it is now. Stock's static layers hand out the very tensor their `update` advances in
        place, and a family that reads it before a layer's update and counts with it after (Inkling's query
        positions, through `get_query_offset`) counts one token ahead: a copy (no device read) keeps the value."""
        length = super().get_seq_length(layer_idx)
        return length.clone() if isinstance(length, torch.Tensor) else length

    def bucketed_length(self, tokens: int) -> int:
        if tokens > self.max_cache_len:
            raise ValueError(f"The cache holds {self.max_cache_len} tokens; this step needs {tokens}.")
        return bucketed_length(tokens, self.bucket_size, self.max_cache_len)

    def prepare_for_new_tokens(self, new_tokens: int) -> None:
        """Call before a forward that adds `new_tokens` tokens (the prompt, then one per decode step)."""
        self.tokens += new_tokens
        bucketed = [layer for layer in self.layers if isinstance(layer, BucketedStaticLayer)]
        if not bucketed:  # sliding-window layers only: they roll past max_cache_len, as stock's do
            return
        length = self.bucketed_length(self.tokens)
        for layer in bucketed:
            layer.set_active_length(length)

    def reset(self) -> None:
        """Empty the cache and keep its storage (Optimum-Habana's `--reuse_cache` reuses it across runs)."""
        super().reset()
        self.tokens = 0
        for layer in self.layers:
            if isinstance(layer, BucketedStaticLayer):
                layer.active_length = self.bucketed_length(1)
