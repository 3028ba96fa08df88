"""Padding-free packed batches: several examples concatenated in one row, each attending to itself alone.

transformers' `DataCollatorWithFlattening` packs examples this way: no padding, `position_ids` restarting at every
example (optionally with `cu_seq_lens_q`/`cu_seq_lens_k`, FlashAttention's boundaries). transformers isolates the
examples by turning the position ids into an N x N block-diagonal mask, and only when no KV cache object exists
(a model called with the default `use_cache=True` builds one, and its examples then attend to each other).

A Gaudi model instead reads the example lengths once per forward (`packed_sequence_lengths`), builds no mask, and
gives them to the attention: the fused path runs the kernel once per example (work and memory grow with the sum
of the squared example lengths, not with the square of their sum), the default path builds the block-diagonal mask
itself. Sliding windows apply within each example, as transformers' mask applies them.
"""

from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from .segmented_attention import causal_mask


# Per row of the batch, the lengths of its examples, in order; they add up to the row's length.
PackedLengths = tuple[tuple[int, ...], ...]


def can_run_packed(config: PreTrainedConfig) -> bool:
    """Whether every layer's mask is causal, optionally windowed: what the packed attention reproduces per example."""
    if not getattr(config, "is_causal", True) or getattr(config, "attention_chunk_size", None):
        return False
    layer_types = getattr(config, "layer_types", None) or ()
    return set(layer_types) <= {"full_attention", "sliding_attention"}


def packed_sequence_lengths(
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None,
    tokens: torch.Tensor,
    kwargs: dict[str, Any],
) -> PackedLengths | None:
    """The example lengths of a packed batch, or None when the batch is not packed.

    Packed means: no attention mask, an empty cache, more than one token, and either FlashAttention's
    `cu_seq_lens_q` (one row) or position ids that restart inside a row. This reads the boundaries to the host once
    per forward, so that no attention layer has to.
    """
    if attention_mask is not None or tokens.shape[1] < 2:
        return None
    if past_key_values is not None and past_key_values.get_seq_length() > 0:
        return None
    boundaries = kwargs.get("cu_seq_lens_q")
    if isinstance(boundaries, torch.Tensor) and tokens.shape[0] == 1:
        ends = boundaries.tolist()
        lengths = tuple(end - start for start, end in zip(ends[:-1], ends[1:], strict=True) if end > start)
        return (lengths,) if len(lengths) > 1 else None
    if position_ids is None:
        return None
    positions = position_ids.expand(tokens.shape[0], -1)
    starts = torch.diff(positions, dim=-1) != 1  # True where the next token starts another example
    if not bool(starts.any()):
        return None
    rows = []
    for row in starts.tolist():
        cuts = [index + 1 for index, cut in enumerate(row) if cut]
        edges = [0, *cuts, positions.shape[1]]
        rows.append(tuple(end - start for start, end in zip(edges[:-1], edges[1:], strict=True)))
    return tuple(rows)


def packed_causal_mask(lengths: PackedLengths, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """The boolean `[B, 1, N, N]` block-diagonal causal mask (windowed when given) of a packed batch.

    For the default path only, which builds the N x N scores anyway; the fused path never calls it.
    """
    masks = []
    for row in lengths:
        example = torch.repeat_interleave(torch.arange(len(row), device=device), torch.tensor(row, device=device))
        same_example = example[:, None] == example[None, :]
        masks.append(same_example & causal_mask(example.shape[0], example.shape[0], sliding_window, device))
    return torch.stack(masks)[:, None]


__all__ = ["PackedLengths", "can_run_packed", "packed_causal_mask", "packed_sequence_lengths"]
