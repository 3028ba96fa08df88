"""The attention part of the fidelity table (`examples/text-generation/attention_fidelity.py`): how far each
attention path is from the exact answer.

Every path is called through the library's own attention function, `gaudi_attention_forward`, with the arguments
a Gaudi model gives it for a prompt (causal, query length = key length; a left-padded batch as the model passes it
on this device), and compared with the same attention computed in float64 from the very inputs the path received.
The model part (`model`) does the same for a whole model's logits and perplexity on real text;
`report` turns the measurements into JSON and Markdown. docs/fidelity.md shows a measured table.
"""

import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optimum.habana.kernels.dispatch import needs_padding_mask
from optimum.habana.kernels.variable_length import PaddedPrompt
from optimum.habana.transformers.attention import gaudi_attention_forward
from optimum.habana.transformers.planned_masks import causal_padding_mask
from optimum.habana.utils.devices import synchronize


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


DEFAULT = "default"


FUSED = "fused"


SOFTMAX_IN_MODEL_DTYPE = "default_attn_softmax_bf16"


FAST_SOFTMAX = "fused_fast_softmax"


ATTENTION_PATHS = (DEFAULT, FUSED, SOFTMAX_IN_MODEL_DTYPE, FAST_SOFTMAX)


# The default path materialises [batch, heads, rows, keys] scores; past this many bytes per block of query rows it
# is called on blocks of rows (each with its rows of the causal mask), which gives bitwise the same output
# (tested) in bounded memory. The fused path never needs it.
SCORE_BLOCK_BYTES = 512 * 1024**2


# The float64 reference's blocks of query rows (it also never holds the whole score matrix).
REFERENCE_BLOCK_BYTES = 256 * 1024**2


# A left-padded batch: one full row and one row a quarter shorter.
PADDED_SHORTER_FRACTION = 4


@dataclass(frozen=True)
class Cell:
    """One attention geometry at one dtype; `sweep` names the part of the grid it belongs to."""

    sweep: str
    dtype: str
    seq_len: int
    head_dim: int
    gqa: int
    padded: bool = False

    @property
    def query_heads(self) -> int:
        return max(2, self.gqa)  # a few heads keep the grid affordable on a CPU

    @property
    def kv_heads(self) -> int:
        return max(1, self.query_heads // self.gqa)

    @property
    def real_lengths(self) -> tuple[int, ...]:
        if not self.padded:
            return (self.seq_len,)
        return (self.seq_len, self.seq_len - self.seq_len // PADDED_SHORTER_FRACTION)

    @property
    def measurement_key(self) -> tuple:
        """Cells of different sweeps with the same key are measured once."""
        return (self.dtype, self.seq_len, self.head_dim, self.gqa, self.padded)


@dataclass(frozen=True)
class GridSpec:
    seq_lens: Sequence[int]
    head_dims: Sequence[int]
    gqa: Sequence[int]
    geometry_seq_lens: Sequence[int]
    padded_seq_lens: Sequence[int]
    base_head_dim: int
    base_gqa: int
    dtypes: Sequence[str]
    full_grid: bool = False


def build_grid(spec: GridSpec) -> list[Cell]:
    """Three sweeps (sequence length, head dim x GQA ratio, left padding), or with `full_grid` every combination."""
    geometries: list[tuple[str, int, int, int, bool]] = []
    if spec.full_grid:
        for padded, lengths in ((False, spec.seq_lens), (True, spec.padded_seq_lens)):
            sweep = "padded" if padded else "full"
            for n in lengths:
                geometries += [(sweep, n, d, g, padded) for d in spec.head_dims for g in spec.gqa]
    else:
        geometries += [("lengths", n, spec.base_head_dim, spec.base_gqa, False) for n in spec.seq_lens]
        for n in spec.geometry_seq_lens:
            geometries += [("geometry", n, d, g, False) for d in spec.head_dims for g in spec.gqa]
        geometries += [("padded", n, spec.base_head_dim, spec.base_gqa, True) for n in spec.padded_seq_lens]
    return [Cell(sweep, dtype, n, d, g, padded) for sweep, n, d, g, padded in geometries for dtype in spec.dtypes]


def make_inputs(cell: Cell, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standard normal query, key and value `[B, H, N, D]` in the cell's dtype, the same for every path.

    Drawn in float32 and rounded once to the cell's dtype; padding positions hold random values too, as a padded
    batch's embeddings do, so a path that attended to them would show it.
    """
    geometry = f"{seed}-{cell.seq_len}-{cell.head_dim}-{cell.gqa}-{cell.padded}"  # independent draws per geometry
    generator = torch.Generator().manual_seed(zlib.crc32(geometry.encode()))
    batch = len(cell.real_lengths)
    shapes = [
        (batch, heads, cell.seq_len, cell.head_dim) for heads in (cell.query_heads, cell.kv_heads, cell.kv_heads)
    ]
    query, key, value = (torch.randn(shape, generator=generator).to(DTYPES[cell.dtype]) for shape in shapes)
    return query, key, value


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: Sequence[int],
    scale: float,
    block_bytes: int = REFERENCE_BLOCK_BYTES,
) -> torch.Tensor:
    """Causal attention over each row's real (rightmost) tokens in float64 on the CPU: `[B, N, H, D]`, zero at padding.

    Blocks of query rows against the keys up to the block's last row keep the memory bounded at any length.
    """
    query, key, value = (tensor.to("cpu", torch.float64) for tensor in (query, key, value))
    batch, heads, seq_len, head_dim = query.shape
    kv_heads = key.shape[1]
    output = torch.zeros(batch, seq_len, heads, head_dim, dtype=torch.float64)
    rows = max(1, block_bytes // (8 * heads * seq_len))
    for row, length in enumerate(lengths):
        start = seq_len - length
        grouped = query[row, :, start:].reshape(kv_heads, heads // kv_heads, length, head_dim)
        keys, values = key[row, :, start:].unsqueeze(1), value[row, :, start:].unsqueeze(1)
        for first in range(0, length, rows):
            last = min(length, first + rows)
            scores = grouped[:, :, first:last] @ keys[:, :, :last].transpose(-1, -2) * scale
            future = torch.arange(last)[None, :] > torch.arange(first, last)[:, None]
            probabilities = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            block = probabilities @ values[:, :, :last]  # [Hkv, groups, rows, D]
            output[row, start + first : start + last] = block.reshape(heads, last - first, head_dim).transpose(0, 1)
    return output


def attention_layer() -> nn.Module:
    """What the attention function reads from its module (`training`, the class name in messages): an eval layer."""
    return nn.Module().eval()


def call_path(
    path: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: Sequence[int],
    scale: float,
    score_block_bytes: int = SCORE_BLOCK_BYTES,
) -> tuple[torch.Tensor, int]:
    """One path's attention output `[B, N, H, D]`, called as a Gaudi model calls it for a prompt; and the number of
    calls it took (the default path runs on blocks of query rows when its scores would not fit in memory)."""
    module, seq_len = attention_layer(), query.shape[2]
    valid = torch.tensor(lengths, dtype=torch.int32, device=query.device)
    padded = any(length != seq_len for length in lengths)
    if path in (FUSED, FAST_SOFTMAX):
        flags = {"use_flash_attention": True, "flash_attention_fast_softmax": path == FAST_SOFTMAX}
        if padded and needs_padding_mask(query, causal_mask_mode=False):  # Gaudi reads the padding mask
            mask = causal_padding_mask(valid, seq_len, "left")
            output, _ = gaudi_attention_forward(module, query, key, value, mask, scaling=scale, **flags)
        else:  # no padding: causal mode; padding on CUDA/CPU: causal mode over the real tokens (valid lengths)
            real = causal_padding_mask(valid, seq_len, "left")[:, 0, -1]  # the last query sees every real key
            extra = {"padded_prompt": PaddedPrompt(real, valid, "left")} if padded else {}
            output, _ = gaudi_attention_forward(module, query, key, value, None, scaling=scale, **flags, **extra)
        return output, 1
    flags = {"attn_softmax_bf16": path == SOFTMAX_IN_MODEL_DTYPE}
    mask = causal_padding_mask(valid, seq_len, "left") if padded else None
    score_bytes = query.shape[0] * query.shape[1] * seq_len * max(4, query.element_size())
    rows = max(1, score_block_bytes // score_bytes)
    if rows >= seq_len:
        return gaudi_attention_forward(module, query, key, value, mask, scaling=scale, **flags)[0], 1
    if mask is None:
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=query.device).tril()[None, None]
    blocks = []
    for first in range(0, seq_len, rows):
        rows_mask = mask[:, :, first : first + rows]
        block = gaudi_attention_forward(
            module, query[:, :, first : first + rows], key, value, rows_mask, scaling=scale, **flags
        )
        blocks.append(block[0])
    return torch.cat(blocks, dim=1), len(blocks)


def output_errors(output: torch.Tensor, reference: torch.Tensor, lengths: Sequence[int]) -> dict[str, Any]:
    """Max and mean absolute error over the real tokens only (padding positions' outputs carry no information)."""
    output = output.to("cpu", torch.float64)
    seq_len = output.shape[1]
    largest, total, count = 0.0, 0.0, 0
    for row, length in enumerate(lengths):
        difference = (output[row, seq_len - length :] - reference[row, seq_len - length :]).abs()
        if not bool(torch.isfinite(difference).all()):
            return {"status": "non-finite", "reason": "the output holds NaN or infinity at real tokens"}
        largest = max(largest, difference.max().item())
        total, count = total + difference.sum().item(), count + difference.numel()
    return {"status": "ok", "max_abs_error": largest, "mean_abs_error": total / count}


def path_applies(path: str, dtype: str, device: torch.device) -> str | None:
    """Why `path` has no value for this dtype and device (the table says so), or None when it is measured."""
    if path == FAST_SOFTMAX and device.type != "hpu":
        return f"n/a on {device.type}"
    if path == SOFTMAX_IN_MODEL_DTYPE and dtype == "fp32":
        return "n/a (fp32: the softmax is fp32 either way)"
    return None


def measure_cell(cell: Cell, device: torch.device, seed: int) -> dict[str, Any]:
    """Every path of one cell against the float64 reference of the same inputs."""
    query, key, value = (tensor.to(device) for tensor in make_inputs(cell, seed))
    scale = cell.head_dim**-0.5
    started = time.perf_counter()
    reference = reference_attention(query, key, value, cell.real_lengths, scale)
    record: dict[str, Any] = {
        "sweep": cell.sweep,
        "dtype": cell.dtype,
        "seq_len": cell.seq_len,
        "head_dim": cell.head_dim,
        "gqa": cell.gqa,
        "query_heads": cell.query_heads,
        "kv_heads": cell.kv_heads,
        "batch": len(cell.real_lengths),
        "real_lengths": list(cell.real_lengths),
        "padded": cell.padded,
        "reference_mean_abs": reference.abs().mean().item(),
        "reference_seconds": time.perf_counter() - started,
        "paths": {},
    }
    for path in ATTENTION_PATHS:
        reason = path_applies(path, cell.dtype, device)
        if reason is not None:
            record["paths"][path] = {"status": "n/a", "reason": reason}
            continue
        synchronize(device)
        started = time.perf_counter()
        with torch.inference_mode():
            output, calls = call_path(path, query, key, value, cell.real_lengths, scale)
        synchronize(device)
        seconds = time.perf_counter() - started
        record["paths"][path] = {
            **output_errors(output, reference, cell.real_lengths),
            "seconds": seconds,
            "calls": calls,
        }
        del output
    return record


def measure_grid(
    cells: Sequence[Cell], device: torch.device, seed: int, on_record: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    """Measure each distinct cell once (a cell shared by two sweeps is reported in both); `on_record` after each."""
    measured: dict[tuple, dict[str, Any]] = {}
    records = []
    for index, cell in enumerate(cells, start=1):
        if cell.measurement_key not in measured:
            started = time.perf_counter()
            measured[cell.measurement_key] = measure_cell(cell, device, seed)
            log(
                f"[attention {index}/{len(cells)}] {cell.dtype} N={cell.seq_len} D={cell.head_dim} GQA={cell.gqa}"
                f"{' padded' if cell.padded else ''}: {time.perf_counter() - started:.1f} s"
            )
        records.append({**measured[cell.measurement_key], "sweep": cell.sweep})
        on_record(records[-1])
    return records


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
