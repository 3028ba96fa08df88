"""A continuous-batching step on the flag's path that reads transformers' paged cache where it lies.

transformers' paged cache (`PagedAttentionCache.update`) writes a step's new keys and values into their pages, then
gathers each sequence's whole cache into a new tensor (`index_select`), in every layer at every step: at long context
that copy costs more than the attention that reads it (22 ms of a 72 ms decode step at 1 x 8192 tokens on
SmolLM2's geometry, CPU). Its gather-free mode (block tables) is for flash-attn's kernels on CUDA only.

Here, on CPU, the step writes through the cache's own `update` with no read asked for (the cache then returns the
new keys and values as they are), and the decode rows of every sequence (one query each) read the pages in place in
one call of the decode kernel (`kernels/cpu_decode.py`), by the slots of the engine's read index. A sequence with
more queries in the step (a prompt or a chunk of one) gathers its own keys only: its attention reads them anyway.
"""

from typing import Any

import torch
from torch import nn
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION

from ..kernels.cpu_decode import paged_decode_applies, paged_decode_sdpa
from ..kernels.variable_length import Segment, fused_attention_per_segment


def check_cache_geometry(
    module: nn.Module, key: torch.Tensor, value: torch.Tensor, cache: PagedAttentionCache
) -> None:
    """One line naming the mismatch, where a family hands the cache keys or values of another geometry than the one
    the engine sized its pages for from the config (`num_key_value_heads`, `head_dim`): the cache's own write would
    fail deep inside it (a family that repeats its key/value heads before the attention, as JetMoe does)."""
    allocator = cache.layer_to_allocator[module.layer_idx]
    heads, head_dim = getattr(allocator, "num_key_value_heads", None), getattr(allocator, "head_dim", None)
    if heads is None or head_dim is None:
        return
    if key.shape[1] != heads or key.shape[-1] != head_dim or value.shape[1:2] + value.shape[3:] != (heads, head_dim):
        raise ValueError(
            f"{type(module).__name__} cannot run in transformers' continuous batching: it hands the attention keys of "
            f"{key.shape[1]} heads of {key.shape[-1]} and values of {value.shape[1]} heads of {value.shape[-1]}, and "
            f"the engine's paged cache holds {heads} heads of {head_dim} (from the config's num_key_value_heads and "
            "head_dim). Use generate() for this model."
        )


def paged_step_in_place(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedAttentionCache,
    cache_kwargs: dict[str, Any],
    bounds: tuple[Segment, ...] | None,
    *,
    scale: float | None,
    fast_softmax: bool,
    recompute: bool,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The step's attention `[1, H, q, D]` (zeros at queries of no sequence), its keys and values written to the
    cache; or None, with nothing written, where the cache cannot be read in place: a step planned inside a graph (no
    `bounds`), a layer kind other than full attention, a block-table step, no decode row, a step with nothing cached
    (its read index is empty: a one-token prompt is then a "decode row" with no page to read), or a call the kernel
    does not take (`paged_decode_applies`). `cache_kwargs`: what the engine passes for the cache (`read_index`, ...);
    `sinks`: one logit per query head, joining every row's softmax."""
    layer_index = module.layer_idx
    allocator = cache.layer_to_allocator[layer_index]
    decoding = [segment for segment in bounds or () if segment.query_end - segment.query_start == 1]
    if not decoding or allocator.layer_type != FULL_ATTENTION or cache_kwargs.get("block_table") is not None:
        return None
    keys, values = (pages.flatten(0, 1) for pages in allocator.get_cache_for_block_table(layer_index))
    if key.shape[-1] != value.shape[-1] or not paged_decode_applies(query, keys, sinks):
        return None
    reads = cache_kwargs["read_index"]
    slots = reads[allocator.index]
    if slots.numel() == 0:  # no sequence of the step has cached tokens: the cache hands back the step's own keys
        return None
    # An empty read index asks the cache to write only: it hands the new keys and values back as they are.
    cache.update(key, value, layer_index, {**cache_kwargs, "read_index": [index[:0] for index in reads]})
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    output = query.new_zeros(query.shape)
    rows = [segment.query_start for segment in decoding]
    output[0, :, rows] = paged_decode_sdpa(
        query[0, :, rows].transpose(0, 1),
        keys,
        values,
        slots,
        [segment.key_start for segment in decoding],
        [segment.key_end - segment.key_start for segment in decoding],
        scale=scale,
        sinks=sinks,
    ).transpose(0, 1)
    for _, query_start, query_end, key_start, key_end in bounds:
        if query_end - query_start == 1:
            continue
        index = slots[key_start:key_end]
        own_keys, own_values = (pages.index_select(0, index).transpose(0, 1)[None] for pages in (keys, values))
        output[:, :, query_start:query_end] = fused_attention_per_segment(
            query[:, :, query_start:query_end],
            own_keys,
            own_values,
            (Segment(0, 0, query_end - query_start, 0, key_end - key_start),),
            scale=scale,
            dropout_p=0.0,
            fast_softmax=fast_softmax,
            recompute=recompute,
            sinks=sinks,
        )
    return output


__all__ = ["check_cache_geometry", "paged_step_in_place"]
