"""Attention sinks as one more key, so that any fused kernel computes them exactly, backward pass included.

A sink is a learned logit per head (gpt-oss, Granite-SWA, MiMo-V2-Flash, ...) that joins every row's softmax and is
then dropped: it only adds `exp(sink)` to the denominator. The same result comes out of a kernel that knows nothing
of sinks when each row gets one extra key whose score is the sink and whose value is zero:

- the query gains one column holding `sink / scale` (per head, or per head and row), every real key a zero there,
  and the extra key is zero but for a one in that column: its score is exactly the sink, the others are unchanged;
- the extra key comes first and every row sees it: with a mask it gets an allowed column; under `is_causal` (a
  prompt from an empty cache, as many queries as keys) a dummy query row is put in front too, so that the kernel's
  top-left causal alignment lets query i see the sink and keys 0..i; the dummy row's output is dropped.

Memory stays O(N): the inputs grow by one position and a few columns. The query's new column is padded to a
multiple of 8 wide, which CUDA's flash kernels need. Gradients reach the sink through the query's column, so
training learns it as the family's own eager attention does.
"""

import torch
import torch.nn.functional as F


# Width added to the head size: one column for the sink, padded to a multiple of 8 (CUDA flash kernels' rule).
SINK_COLUMNS = 8


def sink_logits(sinks: torch.Tensor, batch: int, heads: int, q_len: int) -> torch.Tensor:
    """The sinks as `[B or 1, H, q or 1]` logits: a family passes one per head (`[H]`) or per head and row
    (`[B, H, q, 1]`)."""
    if sinks.dim() == 1:
        return sinks.view(1, heads, 1)
    return sinks.reshape(sinks.shape[0], heads, -1)[..., :q_len]


def with_sink_key(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    sinks: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """The inputs with the sink key in front (see the module docstring) and how many leading output rows to drop.

    query `[B, H, q, D]`, key/value `[B, Hkv, kv, D]`; the scale must be explicit: the head size changes.
    """
    batch, heads, q_len, _ = query.shape
    logits = sink_logits(sinks, batch, heads, q_len).to(query.dtype)
    sink_column = (logits / scale).unsqueeze(-1).expand(batch, heads, q_len, 1)
    query = torch.cat([query, sink_column, query.new_zeros(batch, heads, q_len, SINK_COLUMNS - 1)], dim=-1)
    key = F.pad(key, (0, SINK_COLUMNS))
    sink_key = key.new_zeros(*key.shape[:2], 1, key.shape[-1])
    sink_key[..., -SINK_COLUMNS] = 1.0
    key = torch.cat([sink_key, key], dim=2)
    value = F.pad(value, (0, 0, 1, 0))
    dropped_rows = 0
    if attn_mask is not None:
        allowed = True if attn_mask.dtype == torch.bool else 0.0
        attn_mask = F.pad(attn_mask, (1, 0), value=allowed)
    elif is_causal and q_len > 1:
        query = F.pad(query, (0, 0, 1, 0))  # the dummy row: sees the sink key alone
        dropped_rows = 1
    return query, key, value, attn_mask, dropped_rows


def sinks_per_row(sinks: torch.Tensor, batch: int, heads: int, rows: int) -> torch.Tensor:
    """The decode kernels' sinks (`[H]`, `[H, rows]`, or `[B or 1, H, rows]`: `dispatch.decode_kernel_sinks`) as
    float32 `[B, H, rows]`, broadcast where they are shared (no copy of the logits)."""
    sequences = sinks.shape[0] if sinks.dim() == 3 else 1
    return sinks.float().contiguous().view(sequences, heads, -1).expand(batch, heads, rows)


def sink_weight_column(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks as a last column of `scores` (`[B, Hkv, groups, q, kv]`), for the default path's softmax."""
    batch, kv_heads, groups, q_len, _ = scores.shape
    logits = sink_logits(sinks, batch, kv_heads * groups, q_len).to(scores.dtype)
    logits = logits.view(logits.shape[0], kv_heads, groups, logits.shape[-1], 1)
    return torch.cat([scores, logits.expand(batch, kv_heads, groups, q_len, 1)], dim=-1)


__all__ = ["SINK_COLUMNS", "sink_logits", "sink_weight_column", "sinks_per_row", "with_sink_key"]
