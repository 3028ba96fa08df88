"""The fused kernel once per segment of a row, with no mask across segments: the examples of a padding-free packed
batch (`packing.py`), and the sequences of a continuous-batching step on transformers' paged cache
(`paged_attention.py`).

A segment's queries are the last of its key positions: each query sees the segment's keys up to its own position
(causal, aligned at the bottom right when the segment has more keys than queries, as a prompt chunk after cached
tokens has), within the sliding window when the layer has one. Work and memory grow with the sum over segments of
queries x keys, not with the square of the whole row.
"""

from typing import NamedTuple

import torch

from ..kernels.dispatch import fused_sdpa
from .attention_flags import AttentionFlags


class Segment(NamedTuple):
    """Where one segment's queries and keys lie: the batch row, then half-open ranges along the sequence."""

    row: int
    query_start: int
    query_end: int
    key_start: int
    key_end: int


def causal_mask(query_length: int, key_length: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean `[q, kv]`: query i sits at position kv - q + i and sees the keys up to it, within the window."""
    query_positions = torch.arange(key_length - query_length, key_length, device=device)[:, None]
    key_positions = torch.arange(key_length, device=device)[None, :]
    allowed = key_positions <= query_positions
    if sliding_window is not None:
        allowed &= key_positions > query_positions - sliding_window
    return allowed


def fused_attention_per_segment(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: list[Segment],
    *,
    scaling: float | None,
    dropout: float,
    flags: AttentionFlags,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One fused call per segment; returns `[B, H, q, D]`. Queries in no segment (padding an engine may add) get
    zeros, as a fully masked query does.

    The kernels take no window and no bottom-right alignment, so a segment that needs either reads its own
    `[q, kv]` mask; every other segment runs with `is_causal` (or no mask for a single query). The prefill-only
    flags apply to segments of more than one query, as they do to a prompt.
    """
    output = query.new_zeros(*query.shape[:3], value.shape[-1])
    for row, query_start, query_end, key_start, key_end in segments:
        query_length, key_length = query_end - query_start, key_end - key_start
        windowed = sliding_window is not None and key_length > sliding_window
        needs_mask = windowed or 1 < query_length < key_length
        output[row, :, query_start:query_end] = fused_sdpa(
            query[row : row + 1, :, query_start:query_end],
            key[row : row + 1, :, key_start:key_end],
            value[row : row + 1, :, key_start:key_end],
            causal_mask(query_length, key_length, sliding_window, query.device) if needs_mask else None,
            is_causal=query_length > 1 and not needs_mask,
            scale=scaling,
            dropout_p=dropout,
            softmax_mode="fast" if flags.flash_attention_fast_softmax and query_length > 1 else "None",
            recompute=flags.flash_attention_recompute,
        )[0]
    return output


__all__ = ["Segment", "causal_mask", "fused_attention_per_segment"]
