"""The fused kernel on transformers' paged KV cache (continuous batching), one call per sequence.

In a continuous-batching step the engine packs the queries of every scheduled sequence into one row, the paged
cache returns their keys and values packed the same way (`cu_seq_lens_q`, `cu_seq_lens_k`), and the engine's mask
is one dense `[q_total, kv_total]` matrix that blocks every pair across sequences. Read as it is, a 512-token prompt
chunk scheduled next to 31 sequences of 300 cached tokens scores 512 x 10k pairs of which 512 x 300 count: time
and memory grow with the product of the whole batch's tokens. With the flag, a full-attention layer runs the
fused kernel once per sequence over that sequence's own queries and keys, without the dense mask: a sequence's
queries are the last of its positions, so each query sees its own keys up to its position (causal, aligned at the
bottom right when the sequence has cached tokens before this step).

Sliding-window layers keep the engine's mask: their cache holds the window only, in ring order, with placeholder
slots that only the mask excludes.
"""

import torch

from .attention_flags import AttentionFlags
from .segmented_attention import Segment, fused_attention_per_segment


# The cu_seq_lens_k entry of full-attention layers (transformers keys it by layer type).
FULL_ATTENTION = "full_attention"


def sequence_bounds(
    query_length: int, cu_seq_lens_q: torch.Tensor | None, cu_seq_lens_k: object
) -> list[tuple[int, int, int, int]] | None:
    """Each sequence's `(q_start, q_end, k_start, k_end)` in the packed row, or None when the step does not say.

    `cu_seq_lens_k` is the layer's own tensor once the paged cache has updated the call's keywords, or the engine's
    dict by layer type before.
    """
    if isinstance(cu_seq_lens_k, dict):
        cu_seq_lens_k = cu_seq_lens_k.get(FULL_ATTENTION)
    if not isinstance(cu_seq_lens_q, torch.Tensor) or not isinstance(cu_seq_lens_k, torch.Tensor):
        return None
    queries, keys = cu_seq_lens_q.tolist(), cu_seq_lens_k.tolist()
    if len(queries) != len(keys) or queries[-1] > query_length:
        return None
    return [
        (queries[index], queries[index + 1], keys[index], keys[index + 1])
        for index in range(len(queries) - 1)
        if queries[index + 1] > queries[index]
    ]


def paged_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[tuple[int, int, int, int]],
    scaling: float | None,
    flags: AttentionFlags,
) -> torch.Tensor:
    """One fused call per sequence of the packed row (query `[1, H, q_total, D]`); returns `[1, H, q_total, D]`.

    Queries past the last sequence (padding the engine may add) get zeros, as a fully masked query does.
    """
    segments = [Segment(0, *sequence) for sequence in bounds]
    return fused_attention_per_segment(query, key, value, segments, scaling=scaling, dropout=0.0, flags=flags)


__all__ = ["paged_flash_attention", "sequence_bounds"]
