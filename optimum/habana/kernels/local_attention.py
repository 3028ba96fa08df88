"""Causal attention within a window or a chunk, in O(N) memory: no `[q, kv]` mask, on rows whose tokens start at 0.

Local layers of the 2026 families (sliding windows alternating with full attention in gpt-oss and Gemma 3/4, chunked
layers in Llama 4) read only nearby keys, but a prompt handed to them with transformers' mask costs the full
`[B, 1, q, kv]` mask. Here the rows are cut instead, and one fused call serves every piece:

- a chunk of C tokens: query and key positions in the same chunk, key at or before the query. The rows are cut into
  chunks, stacked along the batch, and attend causally: one call, exact.
- a window of W tokens: key k seen by query q when q - W < k <= q (transformers' sliding-window rule). The queries
  are cut into blocks of W; the block starting at b*W sees the keys of its own block and of the one before, through
  one band mask of `[W, 2W]` shared by every block; the first block runs causally on its own.

Positions count from each row's first token: a padded prompt reaches these functions with its real tokens first
(`variable_length.padded_causal_sdpa`), which keeps the distances transformers' masks measure when a row's padding
is on one side. Rows are padded to whole chunks or blocks with zeros, which only queries past the end can see.
"""

import math

import torch
import torch.nn.functional as F

from .dispatch import fused_sdpa


def chunked_causal_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: int, **options
) -> torch.Tensor:
    """Causal attention within chunks of `chunk` tokens; query `[B, H, N, D]`, key/value `[B, Hkv, N, Dv]`."""
    length = query.shape[2]
    if length <= chunk:
        return fused_sdpa(query, key, value, None, is_causal=True, **options)
    chunks = math.ceil(length / chunk)
    pieces = [_as_pieces(tensor, chunks, chunk) for tensor in (query, key, value)]
    output = fused_sdpa(*pieces, None, is_causal=True, **options)
    return _from_pieces(output, query.shape[0], chunks)[:, :, :length]


def windowed_causal_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int, **options
) -> torch.Tensor:
    """Causal attention over the last `window` keys of each query; query `[B, H, N, D]`, key/value `[B, Hkv, N, Dv]`."""
    length = query.shape[2]
    if length <= window:
        return fused_sdpa(query, key, value, None, is_causal=True, **options)
    blocks = math.ceil(length / window)
    first = fused_sdpa(query[:, :, :window], key[:, :, :window], value[:, :, :window], None, is_causal=True, **options)
    queries = _as_pieces(query, blocks, window)[query.shape[0] :]  # blocks 1, 2, ...: the first ran above
    keys, values = (_with_previous_block(tensor, blocks, window) for tensor in (key, value))
    rows = torch.arange(window, device=query.device)[:, None]
    columns = torch.arange(2 * window, device=query.device)[None, :]
    band = (columns > rows) & (columns <= rows + window)  # key j of the pair sees query i: i < j <= i + W
    rest = fused_sdpa(queries, keys, values, band[None, None], is_causal=False, **options)
    return torch.cat([first, _from_pieces(rest, query.shape[0], blocks - 1)], dim=2)[:, :, :length]


def _as_pieces(tensor: torch.Tensor, pieces: int, size: int) -> torch.Tensor:
    """`[B, H, N, D]` -> `[pieces * B, H, size, D]` (zero-padded to `pieces * size`), piece-major."""
    padded = F.pad(tensor, (0, 0, 0, pieces * size - tensor.shape[2]))
    return padded.unflatten(2, (pieces, size)).permute(2, 0, 1, 3, 4).flatten(0, 1)


def _from_pieces(output: torch.Tensor, batch: int, pieces: int) -> torch.Tensor:
    """The inverse of `_as_pieces`: `[pieces * B, H, size, D]` -> `[B, H, pieces * size, D]`."""
    return output.unflatten(0, (pieces, batch)).permute(1, 2, 0, 3, 4).flatten(2, 3)


def _with_previous_block(tensor: torch.Tensor, blocks: int, size: int) -> torch.Tensor:
    """For blocks 1.. of a `[B, H, N, D]` tensor: each block with the one before it, `[(blocks - 1) * B, H, 2 * size,
    D]`, block-major like `_as_pieces`."""
    padded = F.pad(tensor, (0, 0, 0, blocks * size - tensor.shape[2])).unflatten(2, (blocks, size))
    pairs = torch.cat([padded[:, :, :-1], padded[:, :, 1:]], dim=3)  # [B, H, blocks - 1, 2 * size, D]
    return pairs.permute(2, 0, 1, 3, 4).flatten(0, 1)


__all__ = ["chunked_causal_sdpa", "windowed_causal_sdpa"]
