"""Whether one request fits transformers' paged cache alone, counted as the engine counts it.

transformers' `PagedAttentionCache` groups the layers by attention type (full, sliding window), gives each group an
allocator whose block is one page of each of its layers, and hands out memory in sectors: the least common multiple
of the allocators' block sizes (and 128 bytes), so that a full-attention allocator uses room the sliding layers
leave free. A request holds its prompt and every new token but the last (which is sampled, never fed back); a
sliding-window allocator holds at most its window. Averaged over whole-model blocks, as the check counted before this
module, the count refused requests the engine serves.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads


@dataclass(frozen=True)
class CacheGeometry:
    """The paged cache's sectors for one model and page size, in bytes."""

    page_size: int
    block_bytes: dict[str, int]  # per attention type: one page of each of its layers
    windows: dict[str, int | None]  # per attention type: the tokens its allocator keeps at most
    sector_bytes: int
    model_block_bytes: int  # one page of every layer: the unit of ContinuousBatchingConfig(num_blocks=...)

    def sectors_for(self, tokens: int) -> int:
        """Sectors one request of `tokens` cached tokens takes alone."""
        sectors = 0
        for kind, block_bytes in self.block_bytes.items():
            window = self.windows[kind]
            blocks = math.ceil((tokens if window is None else min(tokens, window)) / self.page_size)
            sectors += math.ceil(blocks / (self.sector_bytes // block_bytes))
        return sectors

    def sectors_of(self, num_blocks: int) -> int:
        """The sectors a cache asked for as `num_blocks` whole-model blocks gets (transformers rounds up)."""
        return max(1, math.ceil(num_blocks * self.model_block_bytes / self.sector_bytes))

    def blocks_for(self, sectors: int) -> int:
        """The fewest whole-model blocks whose cache has `sectors` sectors."""
        return (sectors - 1) * self.sector_bytes // self.model_block_bytes + 1


def cache_geometry(model: Any, page_size: int, dtype: torch.dtype | None = None) -> CacheGeometry:
    """The geometry the engine builds for `model` (or its config) with pages of `page_size` tokens."""
    config = getattr(model, "config", model)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    dtype = dtype or getattr(model, "dtype", None) or torch.float32
    page_bytes = FullAttentionCacheAllocator.get_bytes_per_page(
        find_num_key_value_heads(config), find_head_dim(config), dtype, page_size
    )
    groups = group_layers_by_attn_type(config)
    block_bytes = {kind: len(indices) * page_bytes for kind, indices in groups.items()}
    window = getattr(config, "sliding_window", None)
    return CacheGeometry(
        page_size=page_size,
        block_bytes=block_bytes,
        windows={kind: None if kind == FULL_ATTENTION else window for kind in groups},
        sector_bytes=math.lcm(*block_bytes.values(), 128),
        model_block_bytes=config.num_hidden_layers * page_bytes,
    )


def cached_tokens(prompt_tokens: int, max_new_tokens: int) -> int:
    """What a request's cache holds at its end: the prompt and every new token but the last."""
    return prompt_tokens + max_new_tokens - 1


__all__ = ["CacheGeometry", "cache_geometry", "cached_tokens"]
