"""Fused attention over rows that are not one plain causal sequence: padded prompts, and rows holding several sequences.

- A padded prompt (`PaddedPrompt`): the kernels run causally over each row's real tokens, without the `[B, 1, q, q]`
  padding mask. Right padding needs nothing; other layouts are first permuted so that each row's real tokens come
  first (a gather: O(N) copies, no mask), or, on Gaudi, handed to FusedSDPA's own valid-length mode.
- Several sequences in a row (`Segments`): the examples of a padding-free packed batch, or the requests of a
  continuous-batching step, each attending only to its own keys, causally, aligned at the bottom right.

Each layout comes planned in one of two ways, by `optimum.habana.transformers.batch_layout`, once per forward:
on the host (eager on CPU or CUDA: the padding side, the sequences' bounds as Python numbers), or as tensors only
(inside a graph, and on Gaudi, where nothing may be read to the host). Outputs at padding positions are zero,
except a right-padded prompt's in training (`_mean_of_real_values`) and the last position of a row that ends in
padding, where generate() continues (`_last_padding_query_answered`).
"""

from typing import Literal, NamedTuple

import torch

from . import dispatch
from .dispatch import PaddingSide, SoftmaxMode, fused_sdpa
from .local_attention import chunked_causal_sdpa, windowed_causal_sdpa


# Where a prompt's padding lies: "none", one side, or "any" (not known: decided in the graph, from the mask).
PromptPaddingSide = Literal["none", "left", "right", "any"]


class PaddedPrompt(NamedTuple):
    """A prompt from an empty cache with padding in its rows, run causally over the real tokens."""

    real: torch.Tensor  # bool [B, q]: True at real tokens
    lengths: torch.Tensor  # int32 [B]: real tokens per row (FusedSDPA's valid_seq_len)
    side: PromptPaddingSide


class Segment(NamedTuple):
    """One sequence of a row: the batch row, then half-open ranges of its queries and keys."""

    row: int
    query_start: int
    query_end: int
    key_start: int
    key_end: int


class Segments(NamedTuple):
    """Sequences side by side in each row. A query sees the keys of its own sequence up to its own position.

    Positions count from each sequence's first key; a sequence's queries are its last keys (a prompt chunk after
    cached tokens has more keys than queries). An id of -1 marks a query or key of no sequence (padding an engine
    adds). `bounds` holds the same as Python numbers when the plan was made on the host.
    """

    query_ids: torch.Tensor  # long [B, q]
    query_positions: torch.Tensor  # long [B, q]
    key_ids: torch.Tensor  # long [B, kv]
    key_positions: torch.Tensor  # long [B, kv]
    bounds: tuple[Segment, ...] | None = None


def padded_causal_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prompt: PaddedPrompt,
    *,
    scale: float | None,
    dropout_p: float,
    softmax_mode: SoftmaxMode,
    recompute: bool,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Causal attention over each row's real tokens; query `[B, H, q, D]`, key/value from index 0 -> `[B, H, q, Dv]`.

    FusedSDPA's valid-length mode serves inference on Gaudi (its `valid_seq_len` is an inference argument); elsewhere,
    and in training, a row whose real tokens do not come first is permuted so that they do. `sinks`: one per head.
    A local layer's `window` or `chunk` (`local_attention.py`) counts positions from each row's first real token, as
    transformers' masks do when the padding is on one side: such a prompt must not have padding in the middle.
    """
    if (window or chunk) and prompt.side == "any":
        raise ValueError("a windowed or chunked padded prompt needs its padding on one side: pass its mask instead")
    q_len = query.shape[2]
    key, value = key[:, :, :q_len], value[:, :, :q_len]  # a static cache's unused slots lie past the prompt
    inference = not (query.requires_grad or key.requires_grad or value.requires_grad)
    valid_length_mode = dispatch.on_hpu(query) and inference and prompt.side != "none" and not (window or chunk)
    if sinks is not None:
        valid_length_mode = valid_length_mode and dispatch.kernel_takes_sinks(query, key, value, sinks)
    valid_lengths = prompt.lengths if valid_length_mode else None
    options = {
        "scale": scale,
        "dropout_p": dropout_p,
        "softmax_mode": softmax_mode,
        "recompute": recompute,
        "sinks": sinks,
    }

    def causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, side: PaddingSide) -> torch.Tensor:
        if window:
            return windowed_causal_sdpa(query, key, value, window, **options)
        if chunk:
            return chunked_causal_sdpa(query, key, value, chunk, **options)
        return fused_sdpa(
            query, key, value, None, is_causal=True, valid_sequence_lengths=valid_lengths, padding_side=side, **options
        )

    if prompt.side in ("none", "right") or (prompt.side == "left" and valid_lengths is not None):
        output = causal(query, key, value, "right" if prompt.side == "right" else "left")
    else:
        order = torch.argsort((~prompt.real).to(torch.int32), dim=-1, stable=True)  # real tokens first, in order
        restore = torch.argsort(order, dim=-1)
        permuted = (_gather_positions(tensor, order) for tensor in (query, key, value))
        output = _gather_positions(causal(*permuted, "right"), restore)
    if prompt.side == "none":
        return output
    if prompt.side == "right" and torch.is_grad_enabled() and output.requires_grad:
        output = torch.where(
            prompt.real[:, None, :, None], output, _mean_of_real_values(value, prompt, query.shape[1])
        )
    else:
        output = output.masked_fill(~prompt.real[:, None, :, None], 0.0)
    if prompt.side == "left":  # a row's last position is real
        return output
    return _last_padding_query_answered(output, query, key, value, prompt, window, chunk, options)


def _last_padding_query_answered(
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prompt: PaddedPrompt,
    window: int | None,
    chunk: int | None,
    options: dict,
) -> torch.Tensor:
    """A row that ends in padding gets stock attention at its last position: its query over the row's real keys
    (within the layer's window or chunk), as stock's mask gives it. generate() continues a right-padded prompt from
    there (transformers warns that it should not be), and its tokens must not depend on the flag. One query a row
    over the keys, with a `[B, 1, 1, kv]` mask: a decode step's cost. The other padding positions, which nothing
    continues from, keep their zero."""
    q_len = query.shape[2]
    positions = torch.arange(q_len, device=query.device)
    allowed = prompt.real
    if window:  # right padding: positions count from 0, as transformers' masks do
        allowed = allowed & (positions > q_len - 1 - window)
    if chunk:
        allowed = allowed & (positions // chunk == (q_len - 1) // chunk)
    answers = ~prompt.real[:, -1] & allowed.any(dim=-1)
    # a row with no key to attend to keeps its zero; its mask still lets one key through, so that no NaN is formed
    allowed = allowed | (positions == q_len - 1) & ~allowed.any(dim=-1, keepdim=True)
    options = {**options, "softmax_mode": "None"}  # one query a row: the exact softmax, as decode steps take it
    # contiguous: inductor's backward asserted the slice's strides as the first length's numbers once the length
    # became dynamic (compiled training failed at its third sequence length)
    last = fused_sdpa(query[:, :, -1:].contiguous(), key, value, allowed[:, None, None, :], is_causal=False, **options)
    last = torch.where(answers[:, None, None, None], last.to(output.dtype), output[:, :, -1:])
    return torch.cat([output[:, :, :-1], last], dim=2)


def _mean_of_real_values(value: torch.Tensor, prompt: PaddedPrompt, heads: int) -> torch.Tensor:
    """`[B, H, 1, Dv]`: each row's values averaged over its real tokens, what a padding query after them gets from
    stock attention when its query is zero (a zero padding embedding). In training, padding rows get it instead of
    zeros: their outputs reach no real token, but a family that takes a magnitude without an epsilon (Gemma 3n's
    `mean(h ** 2) ** 0.5`) turns an exactly zero hidden state into NaN gradients for every parameter."""
    real = prompt.real[:, None, :, None].to(value.dtype)
    mean = (value * real).sum(dim=2, keepdim=True) / real.sum(dim=2, keepdim=True).clamp_min(1)
    return mean.repeat_interleave(heads // value.shape[1], dim=1)


def segmented_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    *,
    scale: float | None,
    dropout_p: float,
    fast_softmax: bool,
    recompute: bool,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sequence's queries over its own keys; query `[B, H, q, D]`, key/value `[B, Hkv, kv, Dv]` -> `[B, H, q, Dv]`.

    Planned on the host: one exact call per sequence (the only O(N)-memory option with a backward pass on every
    device). Otherwise one call per layer, the same for every packing: FlexAttention with a block mask where it runs
    (compiled, inference, off Gaudi), else the fused kernel with the sequences' mask.
    """
    if segments.bounds is not None:
        return fused_attention_per_segment(
            query,
            key,
            value,
            segments.bounds,
            scale=scale,
            dropout_p=dropout_p,
            fast_softmax=fast_softmax,
            recompute=recompute,
            sliding_window=sliding_window,
            sinks=sinks,
        )
    if sinks is None and flex_attention_applies(query, key, value):
        output = flex_sdpa(query, key, value, segments, scale=scale, sliding_window=sliding_window)
    else:
        output = fused_sdpa(
            query,
            key,
            value,
            segment_mask(segments, sliding_window),
            is_causal=False,
            scale=scale,
            dropout_p=dropout_p,
            softmax_mode="fast" if fast_softmax and query.shape[2] > 1 else "None",
            recompute=recompute,
            sinks=sinks,
        )
    return output.masked_fill((segments.query_ids < 0)[:, None, :, None], 0.0)


def segment_mask(segments: Segments, sliding_window: int | None = None) -> torch.Tensor:
    """The boolean `[B, 1, q, kv]` mask of `segments` (for the default path, and kernels without FlexAttention)."""
    query_ids, key_ids = segments.query_ids[:, :, None], segments.key_ids[:, None, :]
    query_positions, key_positions = segments.query_positions[:, :, None], segments.key_positions[:, None, :]
    allowed = (query_ids == key_ids) & (query_ids >= 0) & (key_positions <= query_positions)
    if sliding_window is not None:
        allowed &= key_positions > query_positions - sliding_window
    return allowed[:, None]


def flex_attention_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """FlexAttention runs fused only when compiled, has no Gaudi kernel, and no backward pass on CPU."""
    if not torch.compiler.is_compiling() or dispatch.on_hpu(query):
        return False
    needs_grad = query.requires_grad or key.requires_grad or value.requires_grad
    return not (needs_grad and query.device.type == "cpu")


def flex_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    *,
    scale: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """One FlexAttention call whose block mask is built from the sequences' ids: block-sparse, O(N) memory."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    query_ids, query_positions = segments.query_ids, segments.query_positions
    key_ids, key_positions = segments.key_ids, segments.key_positions

    def same_sequence_causal(batch, head, query_index, key_index):
        query_id, query_position = query_ids[batch, query_index], query_positions[batch, query_index]
        key_position = key_positions[batch, key_index]
        allowed = (query_id == key_ids[batch, key_index]) & (query_id >= 0) & (key_position <= query_position)
        if sliding_window is not None:
            allowed &= key_position > query_position - sliding_window
        return allowed

    block_mask = create_block_mask(
        same_sequence_causal, query.shape[0], None, query.shape[2], key.shape[2], device=query.device
    )
    return flex_attention(
        query, key, value, block_mask=block_mask, scale=scale, enable_gqa=key.shape[1] != query.shape[1]
    )


def windowed_causal_mask(
    query_length: int, key_length: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
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
    bounds: tuple[Segment, ...],
    *,
    scale: float | None,
    dropout_p: float,
    fast_softmax: bool,
    recompute: bool,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One fused call per segment (bounds are Python numbers: nothing is read from the device); queries in no segment
    get zeros. The kernels take no window and no bottom-right alignment, so a segment that needs either reads its own
    `[q, kv]` mask; every other segment runs with `is_causal` (or no mask for a single query)."""
    output = query.new_zeros(*query.shape[:3], value.shape[-1])
    for row, query_start, query_end, key_start, key_end in bounds:
        query_length, key_length = query_end - query_start, key_end - key_start
        windowed = sliding_window is not None and key_length > sliding_window
        needs_mask = windowed or 1 < query_length < key_length
        output[row, :, query_start:query_end] = fused_sdpa(
            query[row : row + 1, :, query_start:query_end],
            key[row : row + 1, :, key_start:key_end],
            value[row : row + 1, :, key_start:key_end],
            windowed_causal_mask(query_length, key_length, sliding_window, query.device) if needs_mask else None,
            is_causal=query_length > 1 and not needs_mask,
            scale=scale,
            dropout_p=dropout_p,
            softmax_mode="fast" if fast_softmax and query_length > 1 else "None",
            recompute=recompute,
            sinks=sinks,
        )[0]
    return output


def _gather_positions(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`tensor[b, h, index[b, i]]` for `[B, H, N, D]` tensors and a `[B, N]` index."""
    return tensor.gather(2, index[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3]))


__all__ = [
    "PaddedPrompt",
    "PromptPaddingSide",
    "Segment",
    "Segments",
    "fused_attention_per_segment",
    "padded_causal_sdpa",
    "segment_mask",
    "segmented_sdpa",
    "windowed_causal_mask",
]
