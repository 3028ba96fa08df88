"""A decode step's attention on CPU at the speed of reading the cache, built from `cpu_decode.c` on first use.

At long context a decode step is bound by reading the KV cache, but PyTorch's CPU flash kernel is not: its small
matrix products (a few query rows against blocks of keys) and its softmax made it take about 2x the time of one read
of the cache on a decode step, in every formulation measured (docs/benchmarks.md). `cpu_decode.c` does what such a
step needs and nothing else: the head's few query rows' dot products with its keys and their weighted sum of the
values in blocks held in registers (each key and value loaded once for the rows), an exp that vectorises, the context
cut into chunks so that every thread reads a share (flash-decoding), and the chunks combined exactly.

It is compiled for this machine (`-march=native`, one library per head size and cache dtype: float32, or bfloat16
widened as it is read) into the library's cache folder the first time a decode step needs it, in about 0.2 s, and
runs on PyTorch's own OpenMP threads (the library links
the `libgomp` PyTorch has loaded: a second OpenMP runtime's threads would fight PyTorch's for the cores). Where it
cannot be built (no C compiler, no `libgomp` in this process), one warning says so and PyTorch's kernel runs.
`OPTIMUM_HABANA_CPU_DECODE_KERNEL=0` turns it off.

Its paged entry (`paged_decode_sdpa`) reads transformers' continuous-batching cache where it lies, each sequence's
tokens at the slots the engine's read index names, for every sequence's decode row in one call
(`transformers/paged_attention.py`).
"""

import contextlib
import ctypes
import functools
import os
import warnings

import torch
from transformers.utils.import_utils import is_tracing

from .cpu_decode_library import environment_problem, load_library
from .sinks import sinks_per_row


ENV_VAR = "OPTIMUM_HABANA_CPU_DECODE_KERNEL"
# A decode step's query group, or a few speculative tokens: the kernel keeps rows x CHUNK_MAX scores per thread.
MAX_QUERY_ROWS = 32
MAX_HEAD_DIM = 512
# Each (sequence, head) is cut into at least 2 x threads chunks in all, so the threads share the reads evenly; a
# chunk's scores stay in a core's cache below CHUNK_MAX tokens, and below CHUNK_MIN the combine costs more than the
# balance gains (both measured at 1 x 8192 tokens, SmolLM2's geometry, 2 threads: 512-2048 within 5%).
CHUNK_MIN = 256
CHUNK_MAX = 2048
# A paged call's piece reads all the heads of its tokens, so its scores are all the query heads' rows: 256 tokens keep
# them in a core's first-level cache (measured on SmolLM2's 9 query heads at 512 x 8 to 8192 x 1 tokens, 2 threads:
# 1.1-1.25x faster than 2048, which larger chunks of the dense call's 3 rows do not lose; the register-blocked kernel
# measured 128 to 1024 within noise).
PAGED_CHUNK = 256
# The caches it reads, by the macro that builds it for them: float32, and bfloat16 (widened as it is read).
CACHE_DTYPES = {torch.float32: "", torch.bfloat16: "-DCACHE_BF16"}


def cpu_decode_applies(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    is_causal: bool,
    dropout_p: float,
    sinks: torch.Tensor | None = None,
) -> bool:
    """Whether this call runs on the decode kernel: an eager float32 or bfloat16 call on CPU without gradients, a
    few query rows per head (the caller stacks a decode step's query group as rows), equal head counts and sizes,
    the head size contiguous, no causal mask and no dropout. Decided from shapes and settings; builds the kernel the
    first time. The kernel reads raw memory: every shape it relies on is checked here, and anything else (a value
    cache of another length, a mask of another shape or dtype) is left to PyTorch's kernel, which raises."""
    # torch.compile and torch.export record the operator in their graph (its fake implementation gives the shape);
    # torch.jit.trace and FX cannot see its C call (its output would be recorded as a constant).
    # Each shape is read once: a decode step runs this on every layer, where each read costs a Python object.
    into_graph = _into_graph()
    if not into_graph and (
        type(query) is not torch.Tensor or type(key) is not torch.Tensor or type(value) is not torch.Tensor
    ):
        return False  # no memory behind them
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    batch, heads, rows, head_dim = query.shape
    key_shape, value_shape = key.shape, value.shape
    value_dim = value_shape[3]
    dtype = query.dtype
    if (
        query.device.type != "cpu"
        or (not into_graph and torch.jit.is_tracing())  # the tensors' types above rule out FX's and dynamo's
        or dtype not in CACHE_DTYPES
        or key.dtype != dtype
        or value.dtype != dtype
        or is_causal
        or dropout_p
        or rows > MAX_QUERY_ROWS
        or key_shape[1] != heads
        or key_shape[3] != head_dim  # values may be of another size (latent attention)
        or max(head_dim, value_dim) > MAX_HEAD_DIM
        or key_shape[0] != batch
        or key_shape[:3] != value_shape[:3]
        or query.stride(3) != 1
        or key.stride(3) != 1
        or value.stride(3) != 1
        or batch * heads * rows * head_dim == 0
        or key_shape[2] == 0
    ):
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    if sinks is not None and not _sinks_fit(sinks, batch, heads, rows):
        return False
    if attn_mask is not None and (
        type(attn_mask) is not torch.Tensor
        or not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point())
        or not _mask_fits(attn_mask, (batch, heads, rows, key_shape[2]))
    ):
        return False  # PyTorch's kernel then says what is wrong with it
    return kernel_ready(head_dim, value_dim, dtype)


def _sinks_fit(sinks: torch.Tensor, batch: int, heads: int, rows: int) -> bool:
    """One logit per head (`[H]`), per head and row (`[H, rows]`: a decode step's query group as rows), or per
    sequence, head and row (`[B or 1, H, rows]`), no gradient asked for: the kernel's arithmetic has no backward."""
    return (type(sinks) in (torch.Tensor, torch.nn.Parameter) or _into_graph()) and (
        sinks.is_floating_point()
        and sinks.device.type == "cpu"
        and tuple(sinks.shape) in ((heads,), (heads, rows), (batch, heads, rows), (1, heads, rows))
        and not (torch.is_grad_enabled() and sinks.requires_grad)
    )


@torch._dynamo.assume_constant_result
def kernel_ready(head_dim: int, value_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel is on and built for these head sizes and dtype: decided on the host (building it the first
    time), a constant to a compiled graph."""
    return turned_on() and decode_kernel(head_dim, dtype, value_dim) is not None


def decode_kernel_expected(dtype: torch.dtype) -> bool:
    """Whether eager decode steps on CPU in `dtype` would run on the decode kernel here, without building it (for
    run_generation.py's --explain)."""
    return dtype in CACHE_DTYPES and turned_on() and environment_problem() is None


def turned_on() -> bool:
    """OPTIMUM_HABANA_CPU_DECODE_KERNEL: on unless set to 0 (or false, off, no); any other value is an error, never
    read as one or the other."""
    return _switch(os.environ.get(ENV_VAR, "1"))


@functools.cache
def _switch(value: str) -> bool:
    word = value.strip().lower()
    if word in ("1", "true", "on", "yes"):
        return True
    if word in ("0", "false", "off", "no"):
        return False
    raise ValueError(
        f"{ENV_VAR}={value!r} is neither on nor off: set it to 0 (or false, off, no) to turn the CPU decode kernel "
        "off, or to 1 (or true, on, yes; the default)"
    )


def _mask_fits(attn_mask: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether the mask broadcasts to `shape` (by hand: `torch.broadcast_shapes` costs 19 µs a layer)."""
    return attn_mask.dim() == 4 and all(size in (1, full) for size, full in zip(attn_mask.shape, shape, strict=True))


def cpu_decode_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a few query rows `[B, H, q, D]` over keys `[B, H, L, D]` and values `[B, H, L, Dv]` on the decode
    kernel (`cpu_decode_applies` has said yes). `attn_mask`: boolean (True = attend) or additive, broadcastable to
    `[B, H, q, L]`; `sinks`: one logit per head `[H]`, per head and row `[H, q]` or per sequence, head and row
    `[B or 1, H, q]`, joining each row's softmax. Runs
    as the operator `optimum_habana::cpu_decode_attention`: the profiler names it, torch.compile and torch.export
    keep it."""
    if _into_graph():
        return torch.ops.optimum_habana.cpu_decode_attention(query, key, value, attn_mask, scale, sinks)
    with _named_for_the_profiler("optimum_habana::cpu_decode_attention"):
        return _decode_attention(query, key, value, attn_mask, scale=scale, sinks=sinks)


def _into_graph() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def _named_for_the_profiler(name: str) -> contextlib.AbstractContextManager:
    """The operator's name on the profiler's timeline. Eager calls run the kernel without the dispatcher's round
    trip through the registered operator (tens of microseconds a call, a layer's whole attention on a small model)."""
    return (
        torch.profiler.record_function(name)
        if torch.autograd.profiler._is_profiler_enabled
        else contextlib.nullcontext()
    )


@torch.library.custom_op("optimum_habana::cpu_decode_attention", mutates_args=())
def _decode_attention_operator(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    if not _kernel_takes(query, key, value):  # a compiled graph may hand the operator other strides than eager code
        return _reference_attention(query, key, value, attn_mask, scale, sinks)
    return _decode_attention(query, key, value, attn_mask, scale=scale, sinks=sinks)


@_decode_attention_operator.register_fake
def _(query, key, value, attn_mask, scale, sinks):
    return query.new_empty(*query.shape[:3], value.shape[-1])


def _reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The attention written out in float32 (a softmax of the scaled scores, sinks as one more column of zero
    value): what the kernel computes, for the library's check and for operands the kernel cannot read."""
    scores = query.float() @ key.float().transpose(-1, -2) * scale
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -torch.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
    if sinks is not None:
        column = sinks_per_row(sinks, *scores.shape[:3]).unsqueeze(-1)
        scores = torch.cat([scores, column], dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., : key.shape[2]]
    return (weights @ value.float()).to(query.dtype)


def _kernel_takes(*tensors: torch.Tensor) -> bool:
    return all(tensor.stride(-1) == 1 for tensor in tensors)


def _decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    kernel: ctypes.CDLL | None = None,
) -> torch.Tensor:
    batch, heads, rows, head_dim = query.shape
    value_dim = value.shape[-1]
    length = key.shape[2]
    rows_dtype, query = query.dtype, query.float()  # a few rows: the kernel's arithmetic is float32
    additive = allowed = None
    mask_strides = (0, 0, 0, 0)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(batch, heads, rows, length)
        if attn_mask.dtype == torch.bool:
            allowed = attn_mask.data_ptr()
        else:
            attn_mask = attn_mask.to(torch.float32)  # a view where it is float32 already, as the flag's masks are
            additive = attn_mask.data_ptr()
        mask_strides = attn_mask.stride()
    sink_pointer, sink_strides = None, (0, 0, 0)
    if sinks is not None:
        sinks = sinks_per_row(sinks, batch, heads, rows)
        sink_pointer, sink_strides = sinks.data_ptr(), sinks.stride()
    output = torch.empty(batch, heads, rows, value_dim)
    threads = torch.get_num_threads()
    pieces_per_head = -(-2 * threads // (batch * heads))
    chunk = min(CHUNK_MAX, max(CHUNK_MIN, -(-length // pieces_per_head)))
    kernel = kernel or decode_kernel(head_dim, key.dtype, value_dim)
    failed = kernel.decode_attention(
        query.data_ptr(), *query.stride()[:3],
        key.data_ptr(), *key.stride()[:3],
        value.data_ptr(), *value.stride()[:3],
        additive, allowed, *mask_strides, sink_pointer, *sink_strides,
        output.data_ptr(), batch, heads, rows, length, scale, chunk, threads,
    )  # fmt: skip
    if failed:
        raise MemoryError(f"the CPU decode kernel could not allocate its scratch for {batch} x {heads} x {rows} rows")
    return output.to(rows_dtype)


def paged_decode_applies(query: torch.Tensor, pages: torch.Tensor, sinks: torch.Tensor | None = None) -> bool:
    """Whether a continuous-batching step's decode rows `[1, H, q, D]` can read the paged cache's view `pages`
    (`[slots, Hkv, D]`: a key or value view of transformers' paged cache) in place on the kernel: eager, on CPU,
    float32 or bfloat16 throughout, no gradients, a query group of at most MAX_QUERY_ROWS rows per key/value head,
    and `sinks`, if any, one logit per query head."""
    if sinks is not None and not _sinks_fit(sinks, 1, query.shape[1], 1):
        return False
    if (
        any(type(tensor) is not torch.Tensor for tensor in (query, pages))
        or query.device.type != "cpu"
        or is_tracing(query)
        or query.dtype not in CACHE_DTYPES
        or pages.dtype != query.dtype
        or pages.dim() != 3
        or query.shape[-1] != pages.shape[-1]
        or query.shape[-1] > MAX_HEAD_DIM
        or query.shape[1] % pages.shape[1]
        or query.shape[1] // pages.shape[1] > MAX_QUERY_ROWS
        or pages.stride(-1) != 1
    ):
        return False
    if torch.is_grad_enabled() and query.requires_grad:
        return False
    return kernel_ready(query.shape[-1], query.shape[-1], query.dtype)


def paged_decode_sdpa(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    starts: list[int],
    lengths: list[int],
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query row per sequence, `query [S, H, D]`, over the keys and values of a paged cache where they lie:
    the views `keys`, `values` `[slots, Hkv, D]`, sequence s's tokens at `slots[starts[s]:starts[s] + lengths[s]]`
    (int64). Every row attends to all its sequence's tokens (a decode step's), `sinks` (one logit per query head)
    joining its softmax. Returns `[S, H, D]`. A slot outside the views is an error, never a read. Runs as the
    operator `optimum_habana::paged_decode_attention`."""
    if _into_graph():
        return torch.ops.optimum_habana.paged_decode_attention(
            query, keys, values, slots, starts, lengths, scale, sinks
        )
    with _named_for_the_profiler("optimum_habana::paged_decode_attention"):
        return _paged_decode_attention(query, keys, values, slots, starts, lengths, scale=scale, sinks=sinks)


@torch.library.custom_op("optimum_habana::paged_decode_attention", mutates_args=())
def _paged_decode_operator(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    starts: list[int],
    lengths: list[int],
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    return _paged_decode_attention(query, keys, values, slots, starts, lengths, scale=scale, sinks=sinks)


@_paged_decode_operator.register_fake
def _(query, keys, values, slots, starts, lengths, scale, sinks):
    return query.new_empty(query.shape)


def _paged_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    starts: list[int],
    lengths: list[int],
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    kernel: ctypes.CDLL | None = None,
) -> torch.Tensor:
    sequences, heads, head_dim = query.shape
    kv_heads = keys.shape[1]
    if max(start + length for start, length in zip(starts, lengths, strict=True)) > slots.numel():
        raise ValueError(
            f"the sequences' tokens run past the {slots.numel()} slots the paged cache's read index holds"
        )
    rows_dtype, query = query.dtype, query.float().contiguous()  # one row per head: float32 arithmetic
    slots = slots.to(torch.int64).contiguous()
    bounds = torch.tensor([starts, lengths], dtype=torch.int64)
    sinks = None if sinks is None else sinks.float().contiguous()  # one per query head: the call's rows
    output = torch.empty(sequences, heads, head_dim)
    threads, slot_count = torch.get_num_threads(), min(keys.shape[0], values.shape[0])
    kernel = kernel or decode_kernel(head_dim, keys.dtype)
    failed = kernel.paged_decode_attention(
        query.data_ptr(), *query.stride()[:2],
        keys.data_ptr(), *keys.stride()[:2],
        values.data_ptr(), *values.stride()[:2],
        slot_count, slots.data_ptr(), bounds[0].data_ptr(), bounds[1].data_ptr(),
        None if sinks is None else sinks.data_ptr(),
        output.data_ptr(), sequences, heads, kv_heads, scale, PAGED_CHUNK, threads,
    )  # fmt: skip
    if failed == 2:
        raise ValueError(f"a slot of the paged cache's read index lies outside the {slot_count} it holds")
    if failed:
        raise MemoryError(f"the CPU decode kernel could not allocate its scratch for {sequences} x {heads} rows")
    return output.view(sequences, heads, head_dim).to(rows_dtype)


@functools.cache
def decode_kernel(
    head_dim: int, dtype: torch.dtype = torch.float32, value_dim: int | None = None
) -> ctypes.CDLL | None:
    """The kernel's library for this head size and cache dtype (`decode_attention`, `paged_decode_attention`): built
    or loaded from the cache folder, and checked against the attention written out (`agrees_with_pytorch`) before
    first use (`cpu_decode_library.py`); None, after one warning, where no good library can be had here."""
    value_dim = head_dim if value_dim is None else value_dim
    # Outside any dispatch mode or profiler of the caller's: the check's small attention is no operation of theirs.
    with torch.utils._python_dispatch._disable_current_modes():
        kernel, problem = load_library(head_dim, value_dim, dtype, CACHE_DTYPES[dtype], agrees_with_pytorch)
    if problem is not None:
        warnings.warn(
            f"The CPU decode kernel cannot run here ({problem}): decode steps run on PyTorch's flash kernel, "
            f"slower at long context. Set {ENV_VAR}=0 to silence this.",
            UserWarning,
            stacklevel=2,
        )
    return kernel


def agrees_with_pytorch(kernel: ctypes.CDLL, head_dim: int, value_dim: int, dtype: torch.dtype) -> bool:
    """Whether a freshly loaded library gives the attention's own arithmetic (`_reference_attention`) on a small
    input, through both entries, sinks included: a library that loads but was miscompiled (or built for another CPU)
    must never serve a decode step."""
    generator = torch.Generator().manual_seed(0)
    query, key = (torch.randn(2, 2, length, head_dim, generator=generator).to(dtype) for length in (3, 300))
    value = torch.randn(2, 2, 300, value_dim, generator=generator).to(dtype)
    sinks = torch.randn(2, 2, 3, generator=generator)  # per sequence, head and row: each of the kernel's strides
    query = query.float()  # the rows as the kernel computes them: float32 from the dtype's values
    scale = head_dim**-0.5
    expected = _reference_attention(query, key, value, None, scale, sinks).float()
    dense = _decode_attention(query.to(dtype), key, value, None, scale=scale, sinks=sinks, kernel=kernel).float()
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2  # bfloat16: the output's one rounding
    agrees = torch.allclose(dense, expected, rtol=tolerance, atol=tolerance)
    if value_dim == head_dim:  # the paged entry serves caches of one head size
        pages = (tensor[0].transpose(0, 1) for tensor in (key, value))  # one sequence's tokens as slots
        rows = query[0, :, :1].transpose(0, 1).to(dtype)  # its first query row per head
        plain = _reference_attention(query[:1, :, :1], key[:1], value[:1], None, scale, sinks[0, :, 0]).float()
        paged = _paged_decode_attention(
            rows, *pages, torch.arange(300), [0], [300], scale=scale, sinks=sinks[0, :, 0], kernel=kernel
        )
        agrees = agrees and torch.allclose(paged.float(), plain[0].transpose(0, 1), rtol=tolerance, atol=tolerance)
    return bool(agrees)


__all__ = [
    "ENV_VAR",
    "cpu_decode_applies",
    "cpu_decode_sdpa",
    "decode_kernel",
    "decode_kernel_expected",
    "paged_decode_applies",
    "paged_decode_sdpa",
    "turned_on",
]
