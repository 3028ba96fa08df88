"""The fused scaled-dot-product-attention kernels, per device.

This is the only module that chooses a kernel by device; the Gaudi calls themselves live in `optimum.habana.hpu`.
On Gaudi it calls Habana's `FusedSDPA`; everywhere else PyTorch's `scaled_dot_product_attention` restricted to
the fused backends, so the N x N score matrix is never built. When no fused kernel can take the inputs it raises `FusedSDPAUnavailable`, and the caller decides what to
do (the attention layer warns once and runs the default path).
"""

import functools
import warnings
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.utils.import_utils import is_tracing

from ..hpu import HPUKernel, hpu_kernel, missing_kernel, on_hpu
from .cpu_decode import cpu_decode_applies, cpu_decode_sdpa
from .cpu_features import cpu_native_products
from .decode import query_groups_as_rows
from .sinks import SINK_COLUMNS, with_sink_key
from .split_context import context_splits, split_context_sdpa


SoftmaxMode = Literal["None", "fast"]
PaddingSide = Literal["left", "right"]

# Fused backends only: the math backend materialises the score matrix, which is what flash attention avoids.
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
_OTHER_BACKENDS = [SDPBackend.FLASH_ATTENTION]
# The half-precision dtypes this CPU multiplies natively, read once (a constant to compiled graphs)
CPU_NATIVE_PRODUCTS = cpu_native_products()


class FusedSDPAUnavailable(RuntimeError):
    """No fused kernel can run these inputs on this device; the message says why."""


Kernel = Literal["FusedSDPA", "cpu_decode", "split_context", "pytorch_fused", "pytorch"]


class KernelPath(NamedTuple):
    """How one `fused_sdpa` call runs: the transforms of its inputs, in this order, then one kernel.

    `sink_key`: the sinks as one more key (`sinks.py`), for a kernel that does not take them. `query_rows`: a decode
    step's query group as the rows of its key/value head (`decode.py`). `equal_widths`: latent attention's value head
    padded to the query's (or the query and key to the value's) for a kernel that takes equal sizes only.
    `splits`: the context's pieces for `split_context`.
    """

    sink_key: bool
    query_rows: bool
    equal_widths: bool
    kernel: Kernel
    splits: int = 1

    def describe(self, device: torch.device) -> str:
        """The path in words (run_generation.py's --explain)."""
        kernels = {
            "FusedSDPA": "Habana FusedSDPA",
            "cpu_decode": "the CPU decode kernel (optimum.habana.kernels.cpu_decode)",
            "split_context": f"torch SDPA (cpu flash backend) over the context in {self.splits} pieces",
            "pytorch_fused": kernel_name(device),
            "pytorch": "torch SDPA (PyTorch's own choice of backend: query and value heads of unequal sizes)",
        }
        transforms = {
            "the sinks as one more key": self.sink_key,
            "each query group as the rows of its key/value head": self.query_rows,
            "the value heads padded to the query's size": self.equal_widths,
        }
        done = [words for words, applies in transforms.items() if applies]
        return kernels[self.kernel] + (f" ({'; '.join(done)})" if done else "")


def weights_for_value_product(weights: torch.Tensor) -> torch.Tensor:
    """Attention weights `[..., rows, kv]` laid out for their product with the values `[..., kv, D]` (the default
    path's, latent attention's): column-major for a CPU product of half-precision numbers on a CPU without
    instructions of their own for them, where PyTorch runs it 10-25x faster that way (AVX2: 10.3 -> 0.6 ms for 3
    heads of 3 rows at 8192 tokens in bfloat16, 330 -> 12 ms for DeepSeek-V3's latent); as they are elsewhere: on a
    CPU with them (`CPU_NATIVE_PRODUCTS`; an Intel Xeon with AMX: the column-major copy and product took 1.8-4x the
    row-major product, 2.0 against 1.1 ms for DeepSeek-V3's latent at 8192 tokens), and in float32 (the copy costs
    more than it gains). A copy of the weights, differentiable, never of the cache."""
    if (
        weights.device.type == "cpu"
        and weights.dtype in (torch.bfloat16, torch.float16)
        and weights.dtype not in CPU_NATIVE_PRODUCTS
    ):
        return weights.transpose(-1, -2).contiguous().transpose(-1, -2)
    return weights


def fully_masked_queries(attention_mask: torch.Tensor | None, floor_attends: bool = False) -> torch.Tensor | None:
    """True (shape `[..., q, 1]`) for the query positions that get a zero output: those a mask lets attend to no key.

    Such a position (left padding, or every position of a row whose attention mask is all zeros) gets zero on both
    paths, as from PyTorch's SDPA with a boolean mask: the default path's softmax would otherwise average the values
    uniformly, and Gaudi's kernel, which sees an additive mask, likewise. Real tokens never attend to these positions,
    but a left-padded batch's loss scores the last one's prediction of the first real token. With `floor_attends`, a
    float mask's row of the same finite lowest score at every key is softmaxed as given, into the values' average, as
    stock's eager and SDPA attention both compute it; only a row of -inf is zero, as from SDPA.
    """
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        return ~attention_mask.any(dim=-1, keepdim=True)
    if floor_attends:
        return torch.isneginf(attention_mask).all(dim=-1, keepdim=True)
    return (attention_mask <= torch.finfo(attention_mask.dtype).min).all(dim=-1, keepdim=True)


def kernel_name(device: torch.device) -> str:
    """The device's fused kernel, in words."""
    if device.type == "hpu":
        return "Habana FusedSDPA"
    if device.type == "cuda":
        return "torch SDPA (flash / memory-efficient / cuDNN backends)"
    return f"torch SDPA ({device.type} flash backend)"


def kernel_path(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    is_causal: bool,
    dropout_p: float,
    sinks: torch.Tensor | None,
) -> KernelPath:
    """The path of a `fused_sdpa` call, decided once, from shapes and settings (`fused_sdpa`'s arguments)."""
    decode_step = query.shape[2] == 1 and not is_causal
    grouped = query.shape[1] != key.shape[1]
    if on_hpu(query):
        sink_key = sinks is not None and not kernel_takes_sinks(query, key, value, sinks)
        query_rows = decode_step and grouped and (sinks is None or sink_key)  # FusedSDPA's sinks: one per query head
        return KernelPath(sink_key, query_rows, unequal_widths(query, value, sink_key), "FusedSDPA")
    query_rows = decode_step and grouped
    rows, rows_mask = query_groups_as_rows(query, key.shape[1], attn_mask) if query_rows else (query, attn_mask)
    rows_sinks = None if sinks is None else decode_kernel_sinks(sinks, key.shape[1], query_rows)
    if cpu_decode_applies(rows, key, value, rows_mask, is_causal=is_causal, dropout_p=dropout_p, sinks=rows_sinks):
        # Sinks join each row's softmax and values keep their own width inside the kernel: nothing as long as the
        # context is copied.
        return KernelPath(False, query_rows, False, "cpu_decode")
    splits = context_splits(rows, key, value, rows_mask, is_causal=is_causal, dropout_p=dropout_p)
    if splits > 1:
        # One sequence's decode step on CPU: its context in pieces, so that every thread reads a share; the sinks
        # join as one more piece.
        return KernelPath(False, query_rows, False, "split_context", splits)
    sink_key = sinks is not None
    if unequal_widths(query, value, sink_key):
        if rows.shape[2] == 1:
            # One row of scores per head, whatever the kernel: PyTorch's own choice takes unequal sizes as they are
            # (its math kernel on CPU), where padding the value would copy the whole value cache at every step.
            return KernelPath(sink_key, query_rows, False, "pytorch")
        return KernelPath(sink_key, query_rows, True, "pytorch_fused")
    return KernelPath(sink_key, query_rows, False, "pytorch_fused")


def unequal_widths(query: torch.Tensor, value: torch.Tensor, sink_key: bool) -> bool:
    """Whether the value's head size differs from the query's, a sink key's columns included."""
    return value.shape[-1] != query.shape[-1] + (SINK_COLUMNS if sink_key else 0)


def decode_kernel_sinks(sinks: torch.Tensor, kv_heads: int, query_rows: bool) -> torch.Tensor:
    """The sinks as the CPU decode kernel takes them: one per head `[H]`, or, for a decode step's query groups as
    rows, `[Hkv, groups]`; a family's per-row `[B, H, q, 1]` as `[B, H, q]`, or `[B, Hkv, groups]`."""
    if sinks.dim() == 1:
        return sinks.reshape(kv_heads, -1) if query_rows else sinks
    return sinks.reshape(sinks.shape[0], kv_heads, -1)


def fused_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float | None,
    dropout_p: float = 0.0,
    softmax_mode: SoftmaxMode = "None",
    recompute: bool = False,
    valid_sequence_lengths: torch.Tensor | None = None,
    padding_side: PaddingSide = "left",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention through a fused kernel: query `[B, H, q, D]`, key/value `[B, Hkv, kv, Dv]` -> `[B, H, q, Dv]`.

    `attn_mask` is a boolean (True = attend) or additive mask broadcastable to `[B, H, q, kv]`. With
    `valid_sequence_lengths` (int32 `[B]`, real tokens per row, padding on `padding_side`) the call must be a
    causal prefill without a mask: the kernel skips the padding without a materialised mask. Key and value keep
    their own head count; `sinks` (one logit per head `[H]`, or per head and row `[B, H, q, 1]`) join each row's
    softmax. The path (`kernel_path`) is decided once: the transforms, then one kernel, then the transforms undone.
    """
    if valid_sequence_lengths is not None and (attn_mask is not None or not is_causal):
        raise ValueError("valid_sequence_lengths requires is_causal=True and no attn_mask")
    path = kernel_path(query, key, value, attn_mask, is_causal=is_causal, dropout_p=dropout_p, sinks=sinks)
    if valid_sequence_lengths is not None and path.sink_key:
        raise ValueError("sinks with valid_sequence_lengths need a kernel that takes the sinks")
    if valid_sequence_lengths is not None and path.kernel != "FusedSDPA" and padding_side != "right":
        # PyTorch's kernels have no valid-length mode; right padding is exact under `is_causal` for the real tokens.
        raise ValueError("valid_sequence_lengths with left padding runs on Gaudi only: permute the rows first")
    scale = query.shape[-1] ** -0.5 if scale is None else scale  # explicit: the transforms may widen the heads
    heads, width = query.shape[1], value.shape[-1]
    dropped_rows = 0
    if path.sink_key:
        query, key, value, attn_mask, dropped_rows = with_sink_key(
            query, key, value, attn_mask, is_causal, scale, sinks
        )
        is_causal, sinks = is_causal and attn_mask is None, None
    if path.query_rows:
        query, attn_mask = query_groups_as_rows(query, key.shape[1], attn_mask)
    if path.kernel in ("cpu_decode", "split_context") and sinks is not None:
        sinks = decode_kernel_sinks(sinks, key.shape[1], path.query_rows)
    if path.equal_widths:
        query, key, value = _with_equal_widths(query, key, value)

    options = {"is_causal": is_causal, "scale": scale, "dropout_p": dropout_p}
    if path.kernel != "FusedSDPA" and softmax_mode != "None":
        warn_once(
            f"flash_attention_fast_softmax has no equivalent in PyTorch's fused attention on {query.device.type}: "
            "the exact softmax is used."
        )
    # `recompute` needs nothing off Gaudi: PyTorch's fused kernels never keep the probabilities, backward recomputes.
    if path.kernel == "FusedSDPA":
        kernel = hpu_kernel()
        if kernel is None:
            raise FusedSDPAUnavailable(f"tensors are on HPU but {missing_kernel()}")
        output = _hpu_fused_sdpa(
            kernel, query, key, value, attn_mask, **options, softmax_mode=softmax_mode, recompute=recompute,
            valid_sequence_lengths=valid_sequence_lengths, padding_side=padding_side, sinks=sinks,
        )  # fmt: skip
    elif path.kernel == "cpu_decode":
        output = cpu_decode_sdpa(query, key, value, attn_mask, scale=scale, sinks=sinks)
    elif path.kernel == "split_context":
        output = split_context_sdpa(query, key, value, attn_mask, scale=scale, splits=path.splits, sinks=sinks)
    elif path.kernel == "pytorch":
        enable_gqa = key.shape[1] != query.shape[1]
        output = F.scaled_dot_product_attention(query, key, value, attn_mask, enable_gqa=enable_gqa, **options)
    else:
        output = _torch_fused_sdpa(query, key, value, attn_mask, **options)

    output = output[..., :width]
    if path.query_rows:
        output = output.reshape(output.shape[0], heads, -1, width)
    return output[:, :, dropped_rows:]


def needs_backward(*tensors: torch.Tensor) -> bool:
    """Whether a kernel call is a training call: FusedSDPA decides so when any of its inputs needs a gradient (LoRA on
    `v_proj` alone trains through the value only)."""
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)


def kernel_takes_sinks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor) -> bool:
    """Whether the device's kernel takes these sinks itself: FusedSDPA of a Gaudi software that has the argument, in
    inference (its backward pass returns no gradient for them), one logit per head. Elsewhere `sinks.py` adds them,
    but for the CPU decode kernel's calls (`kernel_path`)."""
    if not on_hpu(query):
        return False
    kernel = hpu_kernel()
    grad = needs_backward(query, key, value, sinks)
    return kernel is not None and kernel.takes_sinks and not grad and sinks.dim() == 1


def _with_equal_widths(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latent attention's value head differs from the query's: pad the narrower side with zeros for the call (the
    scores and the value rows are unchanged; the output is cut back to the value's size). CPU's flash kernel and
    CUDA's flash kernels take equal sizes only. A prompt's copy is O(N); decode steps do not pad (`kernel_path`)."""
    width = value.shape[-1]
    if width < query.shape[-1]:
        return query, key, F.pad(value, (0, query.shape[-1] - width))
    return F.pad(query, (0, width - query.shape[-1])), F.pad(key, (0, width - key.shape[-1])), value


def host_reads_allowed(tensor: torch.Tensor) -> bool:
    """Whether code about to run on `tensor` may read a value to the host: not while a graph is traced or captured
    (torch.compile, CUDA-graph capture, FX or JIT tracing), and never on Gaudi, whose lazy mode and HPU graphs are
    graphs too (a read cuts the graph, and a recorded branch is replayed whatever the data)."""
    return not on_hpu(tensor) and not is_tracing(tensor)


def needs_static_shapes(tensor: torch.Tensor) -> bool:
    """Whether work on `tensor`'s device must keep static shapes: on Gaudi, where lazy mode and HPU graphs build one
    graph per shape (a KV cache attended over its filled slots would build one per decode step)."""
    return on_hpu(tensor)


def needs_padding_mask(tensor: torch.Tensor, causal_mask_mode: bool) -> bool:
    """Whether a padded prompt on `tensor`'s device must reach the fused kernel as a materialised mask.

    On Gaudi it does unless `flash_attention_causal_mask` selects FusedSDPA's valid-length mode (upstream's
    behaviour); PyTorch's fused kernels never need it: `fused_sdpa` runs them causally on the real tokens.
    """
    return on_hpu(tensor) and not causal_mask_mode


def _hpu_fused_sdpa(
    kernel: HPUKernel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float | None,
    dropout_p: float,
    softmax_mode: SoftmaxMode,
    recompute: bool,
    valid_sequence_lengths: torch.Tensor | None,
    padding_side: PaddingSide,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    if softmax_mode == "fast" and recompute and not is_causal and needs_backward(query, key, value):
        warn_once("FusedSDPA's fast softmax in recompute training needs is_causal: the exact softmax is used.")
        softmax_mode = "None"
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(
            ~attn_mask, torch.finfo(query.dtype).min
        )
    if sinks is not None:  # `kernel_takes_sinks`: only the recompute variant reads them
        return kernel.apply(
            query, key, value, attn_mask, dropout_p, is_causal, scale, softmax_mode, True,
            valid_sequence_lengths, padding_side, False, False, (-1, -1), sinks,
        )  # fmt: skip
    if kernel.signature == "1.18":
        return kernel.apply(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            softmax_mode,
            recompute,
            valid_sequence_lengths,
            padding_side,
        )
    if valid_sequence_lengths is not None:
        raise FusedSDPAUnavailable(
            "flash_attention_causal_mask with a padded batch needs Gaudi software 1.18 or later "
            "(FusedSDPA's valid_seq_len argument)"
        )
    if kernel.signature == "1.13" and softmax_mode != "None":
        warn_once("flash_attention_fast_softmax needs Gaudi software 1.16 or later: the exact softmax is used.")
    arguments = [query, key, value, attn_mask, dropout_p, is_causal, scale]
    if kernel.signature == "1.16":
        arguments.append(softmax_mode)
    with kernel.sdp_kernel(enable_recompute=recompute):
        return kernel.apply(*arguments)


def _torch_fused_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    backends = _CUDA_BACKENDS if query.device.type == "cuda" else _OTHER_BACKENDS
    if heads_expanded_for_cuda(query, key):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    options = {
        "attn_mask": attn_mask,
        "dropout_p": dropout_p,
        "is_causal": is_causal,
        "scale": scale,
        "enable_gqa": bool(key.shape[1] != query.shape[1]),  # a traced size is a tensor (torch.jit.trace)
    }
    attend = functools.partial(F.scaled_dot_product_attention, query, key, value, **options)
    if torch.compiler.is_compiling():
        # Dynamo cannot trace warnings.catch_warnings (a graph break per layer, then the recompile limit), so
        # compiled code calls the kernel directly: there, inputs no fused kernel takes are an error, not a fallback.
        with sdpa_kernel(backends):
            return attend()
    if _pytorch_choice(query, key, value, options) in {int(backend) for backend in backends}:
        # PyTorch itself would run a fused kernel for these inputs: call it without the restricting context
        # managers below, which cost about 4% of a batch-8 decode step on CPU (measured against stock sdpa).
        return attend()
    try:
        # PyTorch warns once per backend it rejects; the reason reaches the user through our own warning instead.
        with sdpa_kernel(backends), warnings.catch_warnings(record=True) as rejections:
            warnings.simplefilter("always")
            return attend()
    except RuntimeError as error:
        if "No available kernel" not in str(error):
            raise
        reasons = "; ".join(dict.fromkeys(str(warning.message).strip() for warning in rejections)) or str(error)
        raise FusedSDPAUnavailable(
            f"PyTorch has no fused attention kernel for these inputs on {query.device.type} "
            f"(dtype {query.dtype}, dropout {dropout_p}): {reasons}"
        ) from None


def heads_expanded_for_cuda(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether a call's key and value heads are repeated for each query head before PyTorch's CUDA kernels see them:
    in float32 only the memory-efficient kernel runs there (flash and cuDNN take half precision), and it takes no
    grouped heads (PyTorch's `sdp_utils.cpp`), so a grouped call would find no fused kernel and fall back to the
    default path's N x N scores. The repeated heads cost memory in proportion to the sequence, not its square."""
    return query.device.type == "cuda" and query.dtype == torch.float32 and query.shape[1] != key.shape[1]


def _pytorch_choice(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, options: dict) -> int | None:
    """The SDPA backend PyTorch picks for these inputs (the same selection `scaled_dot_product_attention` runs)."""
    choose = getattr(torch, "_fused_sdp_choice", None)  # private; absent in some builds: use the restricted path
    return None if choose is None else choose(query, key, value, **options)


def warn_once(message: str) -> None:
    """One warning per distinct message and process: the attention runs once per layer and step.

    Never inside a region torch.compile traces: a Python warning breaks a `fullgraph=True` graph, and the same
    call has run uncompiled before (the prompt) or says the same at every step.
    """
    if not torch.compiler.is_compiling():
        _warn_once(message)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=4)


warn_once.cache_clear = _warn_once.cache_clear  # tests reset the "once"


__all__ = [
    "FusedSDPAUnavailable",
    "KernelPath",
    "fully_masked_queries",
    "fused_sdpa",
    "kernel_name",
    "kernel_path",
    "host_reads_allowed",
    "needs_padding_mask",
    "needs_static_shapes",
    "warn_once",
    "weights_for_value_product",
]
