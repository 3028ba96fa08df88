"""A CPU decode step's attention cut along the context, so that every thread has the same share of the cache to read.

PyTorch's CPU flash kernel shares its work out by (batch, head, query block). A decode step of one sequence has a
single query block per key/value head, so it has as many pieces of work as key/value heads: a multi-query model's
one head on 2 threads leaves a thread idle, Llama-3-8B's 8 on 16 threads leave half of them idle. At long context
that step is bound by reading the cache, so idle threads are unread bandwidth.

Attention over a context is a weighted sum that can be taken in pieces (flash-decoding): each piece of the context
gives its output and the log-sum-exp of its scores, and the pieces combine exactly, each weighted by
`exp(lse_piece - lse_total)`. The pieces here are views of the cache (no copy): `[1, H, L, D]` viewed as
`[splits, H, L / splits, D]`, one kernel call for all of them, and a second, tiny one for the last `L mod splits`
tokens. The combine reads `splits` rows per head. Only for one sequence (the batch's sequences would need a copy
to become pieces of one batch dimension) and without gradients (the kernel's log-sum-exp has none). It runs where
the decode kernel (`cpu_decode.py`), which shares a decode step's reads between the threads itself, does not:
float16 caches, or where that kernel cannot be built.
"""

import math

import torch

from .sinks import sinks_per_row


# The least context a piece gets: below this the kernel's fixed cost per piece outweighs the better balance.
MIN_PIECE_TOKENS = 1024
# Cut only a call that would leave at least half the threads idle: the cut has a cost of its own per call (the
# combine, and a second call for the tail), and on this 2-core CPU SmolLM2's 3 heads on 2 threads (3/4 of the
# threads' time used) gained nothing measurable from it, where Gemma-2B's one key/value head did (docs/benchmarks.md).
MAX_THREAD_USE = 0.5
# The dtypes PyTorch's CPU flash kernel runs (it is what `scaled_dot_product_attention` picks for them).
FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The most query rows per head a call may have to be cut: a decode step's query group (one block of the kernel).
MAX_QUERY_ROWS = 32


def context_splits(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    is_causal: bool,
    dropout_p: float,
) -> int:
    """Into how many pieces this call's context is cut (1: not cut), from shapes and settings only. Eager calls
    only: a compiled graph's kernels are its compiler's choice, and the thread count cannot be traced."""
    if (
        torch.compiler.is_compiling()
        or query.dtype not in FLASH_DTYPES
        or query.device.type != "cpu"
        or is_causal
        or dropout_p
        or query.shape[0] != 1
        or query.shape[2] > MAX_QUERY_ROWS
    ):
        return 1
    if (
        len({query.shape[1], key.shape[1], value.shape[1]}) > 1
        or len({query.shape[-1], key.shape[-1], value.shape[-1]}) > 1
    ):
        return 1  # the caller stacks a decode step's query group as rows first; other calls go to the kernel whole
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (query, key, value)):
        return 1
    if attn_mask is not None and (
        attn_mask.dim() != 4 or attn_mask.shape[0] != 1 or attn_mask.shape[-1] != key.shape[2]
    ):
        return 1
    threads = torch.get_num_threads()
    if _thread_use(key.shape[1], threads) > MAX_THREAD_USE:
        return 1
    most = min(threads, key.shape[2] // MIN_PIECE_TOKENS)
    return max(range(1, most + 1), key=lambda splits: _thread_use(key.shape[1] * splits, threads), default=1)


def _thread_use(pieces: int, threads: int) -> float:
    """The share of the threads' time spent working when `pieces` equal pieces of work are shared out."""
    return pieces / (threads * math.ceil(pieces / threads))


def split_context_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    scale: float,
    splits: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one sequence's few query rows `[1, H, q, D]` over its context `[1, H, L, D]`, in `splits`
    pieces of the context, combined exactly. `attn_mask` is boolean (True = attend) or additive, broadcastable to
    `[1, H, q, L]`. `sinks` (the decode kernels' forms, `sinks.sinks_per_row`) join as one more piece: its
    log-sum-exp is the sink, its output zero."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, -math.inf)
    length = key.shape[2]
    piece = length // splits
    whole = piece * splits
    outputs, scores = _attend(
        query.expand(splits, *query.shape[1:]),
        _pieces_view(key[:, :, :whole], splits, 2),
        _pieces_view(value[:, :, :whole], splits, 2),
        None if attn_mask is None else _pieces_view(attn_mask[..., :whole], splits, 3),
        scale,
    )
    if whole < length:
        tail = None if attn_mask is None else attn_mask[..., whole:]
        tail_output, tail_scores = _attend(query, key[:, :, whole:], value[:, :, whole:], tail, scale)
        outputs, scores = torch.cat([outputs, tail_output]), torch.cat([scores, tail_scores])
    if sinks is not None:
        sink_scores = sinks_per_row(sinks, 1, *query.shape[1:3]).to(scores.dtype)
        outputs, scores = torch.cat([outputs, torch.zeros_like(outputs[:1])]), torch.cat([scores, sink_scores])
    return _combine(outputs, scores, rows_may_be_masked=attn_mask is not None).to(query.dtype)


def _pieces_view(tensor: torch.Tensor, splits: int, dim: int) -> torch.Tensor:
    """One sequence's `tensor` (`[1, ...]`) cut along the context dimension `dim` into `splits` pieces side by side
    in the batch dimension: `[1, H, L, D]` -> `[splits, H, L / splits, D]`. A view."""
    return tensor[0].unflatten(dim - 1, (splits, -1)).movedim(dim - 1, 0)


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash kernel, with the log-sum-exp of each row's scores, which the public function drops."""
    output, log_sum_exp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, attn_mask=attn_mask, scale=scale
    )
    if attn_mask is not None:  # the kernel gives a row its mask hides whole a log-sum-exp of 0: it is -inf
        hidden = (attn_mask == -math.inf).all(-1).expand_as(log_sum_exp)
        log_sum_exp = log_sum_exp.masked_fill(hidden, -math.inf)
    return output, log_sum_exp


def _combine(outputs: torch.Tensor, scores: torch.Tensor, rows_may_be_masked: bool) -> torch.Tensor:
    """The pieces' outputs `[P, H, q, D]` weighted by their share of each row's softmax (`scores`: `[P, H, q]`
    log-sum-exps, whose softmax over the pieces is that share); a row no piece may attend to is zero, as the whole
    kernel gives."""
    shares = torch.softmax(scores, 0).unsqueeze(-1)
    combined = (outputs.float() * shares).sum(0, keepdim=True)
    if rows_may_be_masked:  # such a row's scores are all -inf and its shares NaN
        combined = torch.where(scores.isneginf().all(0).unsqueeze(-1), 0.0, combined)
    return combined


__all__ = ["MIN_PIECE_TOKENS", "context_splits", "split_context_sdpa"]
