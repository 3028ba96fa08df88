"""The fused scaled-dot-product-attention kernels, per device.

This is the only module that chooses a kernel by device; the Gaudi calls themselves live in `optimum.habana.hpu`.
On Gaudi it calls Habana's `FusedSDPA`; everywhere else PyTorch's `scaled_dot_product_attention` restricted to
the fused backends, so the N x N score matrix is never built. When no fused kernel can take the inputs it raises `FusedSDPAUnavailable`, and the caller decides what to
do (the attention layer warns once and runs the default path).
"""

import functools
import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.utils.import_utils import is_tracing

from ..hpu import HPUKernel, hpu_kernel, on_hpu
from .cpu_decode import cpu_decode_applies, cpu_decode_sdpa
from .decode import query_groups_as_rows
from .sinks import with_sink_key
from .split_context import context_splits, split_context_sdpa


SoftmaxMode = Literal["None", "fast"]
PaddingSide = Literal["left", "right"]

# Fused backends only: the math backend materialises the score matrix, which is what flash attention avoids.
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
_OTHER_BACKENDS = [SDPBackend.FLASH_ATTENTION]


class FusedSDPAUnavailable(RuntimeError):
    """No fused kernel can run these inputs on this device; the message says why."""


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
    causal prefill without a mask: the kernel skips the padding without a materialised mask.
    Key and value keep their own head count: the kernels handle grouped-query attention themselves, except for a
    decode step (one query position), whose query group is stacked as the rows of its key/value head
    (`kernels.decode`): the kernels would otherwise read the cache once per query head. A value head size other
    than the query's (latent attention) is padded for the call only. `sinks` (one logit per head, or per head and
    row) join each row's softmax (`sinks.py`).
    """
    if valid_sequence_lengths is not None and (attn_mask is not None or not is_causal):
        raise ValueError("valid_sequence_lengths requires is_causal=True and no attn_mask")
    scale = query.shape[-1] ** -0.5 if scale is None else scale  # explicit: the calls below may widen the heads
    decode_kernel_sinks = sinks is not None and decode_kernel_takes_sinks(
        query, key, value, attn_mask, is_causal=is_causal, dropout_p=dropout_p, sinks=sinks
    )
    if sinks is not None and not kernel_takes_sinks(query, key, sinks) and not decode_kernel_sinks:
        if valid_sequence_lengths is not None:
            raise ValueError("sinks with valid_sequence_lengths need a kernel that takes the sinks")
        query, key, value, attn_mask, dropped_rows = with_sink_key(
            query, key, value, attn_mask, is_causal, scale, sinks
        )
        output = fused_sdpa(
            query, key, value, attn_mask, is_causal=is_causal and attn_mask is None, scale=scale,
            dropout_p=dropout_p, softmax_mode=softmax_mode, recompute=recompute,
        )  # fmt: skip
        return output[:, :, dropped_rows:]
    if (
        query.shape[2] == 1
        and not is_causal
        and query.shape[1] != key.shape[1]
        and (sinks is None or decode_kernel_sinks)
    ):
        # A decode step: the query group as rows of its key/value head, each cached key and value read once.
        rows, rows_mask = query_groups_as_rows(query, key.shape[1], attn_mask)
        rows_sinks = None if sinks is None else sinks.reshape(key.shape[1], -1)  # per head: per row of its group
        options = {"scale": scale, "dropout_p": dropout_p, "softmax_mode": softmax_mode, "recompute": recompute}
        output = fused_sdpa(rows, key, value, rows_mask, is_causal=False, sinks=rows_sinks, **options)
        return output.view(*query.shape[:3], output.shape[-1])
    if decode_kernel_sinks or (
        value.shape[-1] != query.shape[-1]
        and not on_hpu(query)
        and cpu_decode_applies(query, key, value, attn_mask, is_causal=is_causal, dropout_p=dropout_p)
    ):
        # A decode step on CPU with sinks, or with latent attention's values of another size: the decode kernel takes
        # both as they are (the sinks join each row's softmax, the weighted sum runs over the values' own width),
        # where padding the keys with a sink column or the values to the query's size would copy the whole cache.
        return cpu_decode_sdpa(query, key, value, attn_mask, scale=scale, sinks=sinks)
    if value.shape[-1] != query.shape[-1] and query.shape[2] == 1 and not on_hpu(query):
        # A decode step of latent attention: one row of scores per head, whatever the kernel. PyTorch's own choice
        # takes the unequal sizes as they are (its math kernel on CPU), where padding the value would copy the
        # whole value cache at every step.
        enable_gqa = key.shape[1] != query.shape[1]
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa
        )
    if value.shape[-1] != query.shape[-1]:
        return _with_equal_head_sizes(
            query, key, value, attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
            softmax_mode=softmax_mode, recompute=recompute, valid_sequence_lengths=valid_sequence_lengths,
            padding_side=padding_side, sinks=sinks,
        )  # fmt: skip
    if on_hpu(query):
        kernel = hpu_kernel()
        if kernel is None:
            raise FusedSDPAUnavailable("tensors are on HPU but habana_frameworks cannot be imported")
        return _hpu_fused_sdpa(
            kernel,
            query,
            key,
            value,
            attn_mask,
            is_causal=is_causal,
            scale=scale,
            dropout_p=dropout_p,
            softmax_mode=softmax_mode,
            recompute=recompute,
            valid_sequence_lengths=valid_sequence_lengths,
            padding_side=padding_side,
            sinks=sinks,
        )
    if softmax_mode != "None":
        warn_once(
            f"flash_attention_fast_softmax has no equivalent in PyTorch's fused attention on {query.device.type}: "
            "the exact softmax is used."
        )
    # `recompute` needs nothing here: PyTorch's fused kernels never keep the probabilities, backward recomputes them.
    if valid_sequence_lengths is not None and padding_side != "right":
        # PyTorch's kernels have no valid-length mode; right padding is exact under `is_causal` for the real tokens.
        raise ValueError("valid_sequence_lengths with left padding runs on Gaudi only: permute the rows first")
    if cpu_decode_applies(query, key, value, attn_mask, is_causal=is_causal, dropout_p=dropout_p):
        # A decode step on CPU (float32, bfloat16): the kernel built for it reads the cache once, on every thread.
        return cpu_decode_sdpa(query, key, value, attn_mask, scale=scale)
    splits = context_splits(query, key, value, attn_mask, is_causal=is_causal, dropout_p=dropout_p)
    if splits > 1:  # one sequence's decode step on CPU: its context in pieces, so that every thread reads a share
        return split_context_sdpa(query, key, value, attn_mask, scale=scale, splits=splits)
    return _torch_fused_sdpa(query, key, value, attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p)


def decode_kernel_takes_sinks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    is_causal: bool,
    dropout_p: float,
    sinks: torch.Tensor,
) -> bool:
    """Whether the CPU decode kernel takes this decode step with its sinks as they are (one logit per head; per row
    of its key/value head where the query group is stacked): no sink column is then added to the keys."""
    if is_causal or on_hpu(query):
        return False
    if query.shape[1] != key.shape[1]:
        if sinks.dim() != 1 or query.shape[2] != 1:
            return False
        query, attn_mask = query_groups_as_rows(query, key.shape[1], attn_mask)
        sinks = sinks.reshape(key.shape[1], -1)
    return cpu_decode_applies(query, key, value, attn_mask, is_causal=False, dropout_p=dropout_p, sinks=sinks)


def kernel_takes_sinks(query: torch.Tensor, key: torch.Tensor, sinks: torch.Tensor) -> bool:
    """Whether the device's kernel takes these sinks itself: FusedSDPA of a Gaudi software that has the argument, in
    inference (its backward pass returns no gradient for them), one logit per head. Elsewhere `sinks.py` adds them."""
    if not on_hpu(query):
        return False
    kernel = hpu_kernel()
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or sinks.requires_grad)
    return kernel is not None and kernel.takes_sinks and not grad and sinks.dim() == 1


def _with_equal_head_sizes(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs
) -> torch.Tensor:
    """Latent attention's value head differs from the query's: pad the narrower side with zeros for the call (the
    scores and the value rows are unchanged) and cut the output back to the value's size. CPU's flash kernel and
    CUDA's flash kernels take equal sizes only. A prompt's copy is O(N); decode steps do not pad (above)."""
    width = value.shape[-1]
    if width < query.shape[-1]:
        value = F.pad(value, (0, query.shape[-1] - width))
    else:
        query, key = F.pad(query, (0, width - query.shape[-1])), F.pad(key, (0, width - key.shape[-1]))
    return fused_sdpa(query, key, value, *args, **kwargs)[..., :width]


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
    if softmax_mode == "fast" and recompute and not is_causal and query.requires_grad:
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
    options = {
        "attn_mask": attn_mask,
        "dropout_p": dropout_p,
        "is_causal": is_causal,
        "scale": scale,
        "enable_gqa": key.shape[1] != query.shape[1],
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
    "fused_sdpa",
    "host_reads_allowed",
    "needs_padding_mask",
    "needs_static_shapes",
    "warn_once",
]
