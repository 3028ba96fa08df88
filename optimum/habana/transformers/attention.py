"""The Gaudi attention: one function that transformers' attention interface calls for every layer of every family.

With `use_flash_attention` it runs the fused kernel of the device (`optimum.habana.kernels`); otherwise, or when
no fused kernel can honour the call (soft-capped logits, or inputs the device's kernel rejects), the explicit
matmul-softmax attention. It is registered under the names "gaudi" and "gaudi_fused_sdpa" together with
transformers' SDPA mask function, so any model family that looks its attention up through
`ALL_ATTENTION_FUNCTIONS` can use it by setting `attn_implementation="gaudi"`.

The mask contract (from `transformers.masking_utils`): a boolean `[B, 1, q, kv]` mask (True = attend) or an
additive float mask, or None when causality alone is exact: "causal, top-left aligned" for q > 1, "no mask" for
q == 1. Sliding windows are part of the mask, so both paths honour them by reading it; so are packed sequences,
except in a Gaudi model, which hands the attention their lengths instead (`packing.py`).
"""

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils.generic import TransformersKwargs

from ..kernels.dispatch import FusedSDPAUnavailable, fused_sdpa, warn_once
from .attention_flags import DEFAULT_PATH_FLAGS, AttentionFlags, attention_flags_of, call_attention_flags
from .packing import PackedLengths, packed_causal_mask
from .paged_attention import paged_flash_attention, sequence_bounds
from .segmented_attention import Segment, fused_attention_per_segment


ATTENTION_IMPLEMENTATION = "gaudi"
# Optimum-Habana's name for the fused attention; registered as the same function.
FUSED_SDPA_IMPLEMENTATION = "gaudi_fused_sdpa"
# The name a Gaudi model's config carries while a padded prompt runs the fused path without a mask: its mask
# function builds nothing, the attention gets the per-row valid lengths instead (`GaudiAttentionMixin.forward`).
MASK_FREE_PREFILL = "gaudi_mask_free_prefill"

# Keywords that reach every attention function and need nothing here: the model or the mask has already used them
# (positions, packed-sequence boundaries, caching), they switch model-level outputs, or they are the loss's, which
# a stock forward hands down with everything else (`shift_labels` in sequence-parallel training). transformers'
# own list (`TransformersKwargs`) is read, so a keyword it adds is known here too. Any other keyword is an error,
# so that a family feature is never dropped silently.
IGNORED_ATTENTION_KWARGS = (
    frozenset(TransformersKwargs.__annotations__) - {"output_attentions", "is_causal"}  # both read below
) | {"cache_position", "use_cache", "shift_labels", "ignore_index"}
# What transformers' continuous batching passes besides its paged cache: the cache reads them in `update`, the
# engine reads the logits ones; its 4-D mask already encodes every sequence's boundaries and cached tokens.
CONTINUOUS_BATCHING_KWARGS = frozenset(
    {"read_index", "write_index", "block_table", "logits_indices", "logits_processor_args"}
)


def gaudi_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    output_attentions: bool | None = None,
    valid_sequence_lengths: torch.Tensor | None = None,
    padding_side: str = "left",
    packed_sequence_lengths: PackedLengths | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention for query `[B, H, q, D]` and key/value `[B, Hkv, kv, D]`; returns `([B, q, H, D], weights)`.

    The flags arrive as keyword arguments from the model's forward. `valid_sequence_lengths` (int32 `[B]`) marks
    a prefill from an empty cache whose batch is padded on `padding_side`; with `flash_attention_causal_mask` the
    fused kernel then runs causally over the real tokens instead of reading a mask. `packed_sequence_lengths`
    marks a padding-free packed batch (`optimum.habana.transformers.packing`), which comes without a mask.
    Weights are returned by the default path only: the fused kernel never materialises them.
    """
    flags = call_attention_flags(kwargs, model_flag_defaults(module))
    cache = kwargs.pop("cache", None)
    paged_bounds = None
    if isinstance(cache, PagedAttentionCache):  # continuous batching: the layer writes and reads its paged cache
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
        if sliding_window is None:
            paged_bounds = sequence_bounds(query.shape[2], kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))
        for name in CONTINUOUS_BATCHING_KWARGS:
            kwargs.pop(name, None)
    elif cache is not None:
        kwargs["cache"] = cache  # named among the unknown arguments below
    unknown = set(kwargs) - IGNORED_ATTENTION_KWARGS
    if unknown:
        raise TypeError(
            f"The Gaudi attention does not know the argument(s) {sorted(unknown)} that {type(module).__name__} passes, "
            "so it cannot honour them. This model family is not supported by optimum.habana: use transformers' own "
            "attn_implementation for it."
        )
    if packed_sequence_lengths is not None:
        q_len = query.shape[2]
        key, value = key[:, :, :q_len], value[:, :, :q_len]  # a static cache's unused slots lie past the batch
    if flags.use_flash_attention:
        for name in DEFAULT_PATH_FLAGS:
            if getattr(flags, name):
                warn_once(
                    f"{name} with use_flash_attention: the fused kernel computes its own softmax, so {name} applies "
                    "only to the calls that take the default path (soft-capped logits, attention weights asked for)."
                )
        reason = fused_path_refusal(module, softcap, output_attentions)
        if reason is None and paged_bounds is not None:
            try:
                output = paged_flash_attention(query, key, value, paged_bounds, scaling, flags)
                return output.transpose(1, 2).contiguous(), None
            except FusedSDPAUnavailable as error:
                reason = str(error)
        elif reason is None and packed_sequence_lengths is not None:
            try:
                output = packed_flash_attention(
                    module, query, key, value, packed_sequence_lengths, scaling, dropout, flags, sliding_window
                )
                return output.transpose(1, 2).contiguous(), None
            except FusedSDPAUnavailable as error:
                reason = str(error)
        elif reason is None:
            try:
                output = flash_attention(
                    module,
                    query,
                    key,
                    value,
                    attention_mask,
                    scaling,
                    dropout,
                    flags,
                    sliding_window,
                    is_causal,
                    valid_sequence_lengths,
                    padding_side,
                )
                masked = fully_masked_queries(attention_mask)
                if masked is not None:
                    output = output.masked_fill(masked, 0.0)
                return output.transpose(1, 2).contiguous(), None
            except FusedSDPAUnavailable as error:
                reason = str(error)
        warn_once(f"use_flash_attention: {reason}. Running the default attention instead; results are unchanged.")
    if attention_mask is None and valid_sequence_lengths is not None and query.shape[2] > 1:
        # A mask-free padded prefill that ends up here needs its padding mask after all.
        attention_mask = causal_padding_mask(valid_sequence_lengths, query.shape[2], padding_side)
    if attention_mask is None and packed_sequence_lengths is not None:
        attention_mask = packed_causal_mask(packed_sequence_lengths, sliding_window, query.device)
    softmax_dtype = query.dtype if flags.attn_softmax_bf16 else torch.float32
    return matmul_softmax_attention(
        query,
        key,
        value,
        attention_mask,
        scaling,
        dropout if module.training else 0.0,
        softmax_dtype,
        softcap=softcap,
        is_causal=is_causal is not False,
    )


def fused_path_refusal(module: nn.Module, softcap: float | None, output_attentions: bool | None) -> str | None:
    """Why this call cannot run in a fused kernel exactly, or None when it can."""
    if softcap is not None:
        return (
            f"{type(module).__name__} soft-caps its attention logits (softcap={softcap}), which no fused kernel "
            "computes; its calls take the default path"
        )
    if output_attentions:
        return "output_attentions=True asks for the attention weights, which the fused kernel never materialises"
    return None


def flash_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    flags: AttentionFlags,
    sliding_window: int | None,
    is_causal: bool | None,
    valid_sequence_lengths: torch.Tensor | None,
    padding_side: str,
) -> torch.Tensor:
    """Choose the kernel arguments for this phase; returns `[B, H, q, D]`."""
    q_len = query.shape[2]
    is_prefill = q_len > 1
    if not is_prefill or (attention_mask is not None and not flags.flash_attention_causal_mask):
        # Valid lengths replace the mask when transformers built none (a mask-free prefill) or when asked to.
        valid_sequence_lengths = None
    if valid_sequence_lengths is not None and sliding_window is not None and q_len > sliding_window:
        # Valid lengths replace the mask, and the mask is what carries the window: keep the mask for this layer.
        warn_once(
            f"flash_attention_causal_mask: {type(module).__name__} attends within a sliding window of "
            f"{sliding_window} tokens, shorter than this prompt ({q_len}); its layers read the mask to keep the window."
        )
        valid_sequence_lengths = None
    if valid_sequence_lengths is not None or (attention_mask is None and is_prefill and is_causal is not False):
        # Causal prefill from an empty cache: a static cache's unused slots lie past the prompt, drop them.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        attention_mask, causal = None, True
    else:
        causal = False
    output = fused_sdpa(
        query,
        key,
        value,
        attention_mask,
        is_causal=causal,
        scale=scaling,
        dropout_p=dropout if module.training else 0.0,
        # The fast softmax pays off on long prompts only; decode stays exact (it cost throughput there).
        softmax_mode="fast" if flags.flash_attention_fast_softmax and is_prefill else "None",
        # Recomputation trades compute for memory where there is memory to save: prefill and training.
        recompute=flags.flash_attention_recompute and (is_prefill or module.training),
        valid_sequence_lengths=valid_sequence_lengths,
        padding_side=padding_side,
    )
    if valid_sequence_lengths is None:
        return output
    recompute = flags.flash_attention_recompute and (is_prefill or module.training)
    return padding_queries_as_stock(
        output, query, key, value, valid_sequence_lengths, padding_side, scaling, recompute
    )


def padding_queries_as_stock(
    output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid_sequence_lengths: torch.Tensor,
    padding_side: str,
    scaling: float | None,
    recompute: bool,
) -> torch.Tensor:
    """The outputs at a mask-free prefill's padding positions, as transformers' mask gives them.

    Under the mask, a left-padding query attends to nothing (zero), and a right-padding query attends to its row's
    real tokens, all of which come before it. The causal kernel let the latter see the padding before it too, and
    devices differ on the former, so both are set here: the real tokens' outputs are untouched, and each
    right-padded row costs one more kernel call for its padding queries (O(padding x real) work, no mask).
    """
    q_len = query.shape[2]
    positions = torch.arange(q_len, device=query.device)
    lengths = valid_sequence_lengths.to(query.device, torch.long)
    if padding_side == "left":
        return output.masked_fill((positions < (q_len - lengths)[:, None])[:, None, :, None], 0.0)
    padding_outputs = torch.zeros_like(output)
    for row, length in enumerate(lengths.tolist()):
        if 0 < length < q_len:
            padding_outputs[row : row + 1, :, length:] = fused_sdpa(
                query[row : row + 1, :, length:],
                key[row : row + 1, :, :length],
                value[row : row + 1, :, :length],
                None,
                is_causal=False,
                scale=scaling,
                recompute=recompute,
            )
    return torch.where((positions >= lengths[:, None])[:, None, :, None], padding_outputs, output)


def packed_flash_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: PackedLengths,
    scaling: float | None,
    dropout: float,
    flags: AttentionFlags,
    sliding_window: int | None,
) -> torch.Tensor:
    """One causal kernel call per packed example, no mask across them; returns `[B, H, q, D]`.

    An example longer than a sliding window reads its own `[length, length]` window mask: the kernels have no
    window argument. Every call is a prefill, so the prefill-only flags apply as they do to a prompt.
    """
    segments = []
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            segments.append(Segment(row, start, start + length, start, start + length))
            start += length
    return fused_attention_per_segment(
        query,
        key,
        value,
        segments,
        scaling=scaling,
        dropout=dropout if module.training else 0.0,
        flags=flags,
        sliding_window=sliding_window,
    )


def matmul_softmax_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float = 0.0,
    softmax_dtype: torch.dtype = torch.float32,
    *,
    softcap: float | None = None,
    is_causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The default path: `softmax(cap(Q Kᵀ * scale) + mask) V`, with the full score matrix.

    `softcap` bounds the logits as `softcap * tanh(logits / softcap)` before the mask, as Gemma 2 trains with.
    Grouped-query attention views the query as `[B, Hkv, groups, q, D]` so key/value are never repeated.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    scaling = head_dim**-0.5 if scaling is None else scaling
    grouped_query = query.view(batch, kv_heads, heads // kv_heads, q_len, head_dim)

    scores = torch.matmul(grouped_query, key.unsqueeze(2).transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None and q_len > 1 and is_causal:
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
    if attention_mask is not None:
        if attention_mask.dim() == 4:
            attention_mask = attention_mask.unsqueeze(2)  # [B, 1 or H, q, kv] -> broadcast over the groups
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask

    probabilities = nn.functional.softmax(scores, dim=-1, dtype=softmax_dtype).to(query.dtype)
    masked = fully_masked_queries(attention_mask)
    if masked is not None:
        probabilities = probabilities.masked_fill(masked, 0.0)
    probabilities = nn.functional.dropout(probabilities, p=dropout, training=dropout > 0.0)
    # The weights returned are the tensor the output is computed from: a caller's retain_grad() on them sees grads.
    weights = probabilities.view(batch, heads, q_len, kv_len)
    output = torch.matmul(weights.view(batch, kv_heads, heads // kv_heads, q_len, kv_len), value.unsqueeze(2))
    output = output.view(batch, heads, q_len, -1).transpose(1, 2).contiguous()
    return output, weights


def fully_masked_queries(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """True (shape `[..., q, 1]`) for the query positions whose mask lets them attend to no key at all.

    Such a position (left padding, or every position of a row whose attention mask is all zeros) gets a zero
    attention output on both paths, which is what PyTorch's fused SDPA returns for it: the softmax of a fully
    masked row would otherwise average the values uniformly on one path and give 0 (or NaN) on another. Real
    tokens never attend to these positions, so only their own, meaningless, outputs are set.
    """
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        return ~attention_mask.any(dim=-1, keepdim=True)
    return (attention_mask <= torch.finfo(attention_mask.dtype).min).all(dim=-1, keepdim=True)


def causal_padding_mask(valid_sequence_lengths: torch.Tensor, q_len: int, padding_side: str) -> torch.Tensor:
    """The boolean `[B, 1, q, q]` mask of a causal prefill whose rows hold `valid_sequence_lengths` real tokens."""
    positions = torch.arange(q_len, device=valid_sequence_lengths.device)
    if padding_side == "left":
        real = positions >= (q_len - valid_sequence_lengths)[:, None]
    else:
        real = positions < valid_sequence_lengths[:, None]
    causal = positions[None, :] <= positions[:, None]
    return (causal[None] & real[:, None, :])[:, None]


def no_mask(*args, **kwargs) -> None:
    """The mask function of `MASK_FREE_PREFILL`: the attention reads valid lengths instead."""
    return None


class AttentionConfigView:
    """A model config as the attention layers of a Gaudi model read it, with the model's own flag defaults.

    Every value is read live from the model's config, except `_attn_implementation`, which names the Gaudi
    attention. The config itself keeps what the user asked for ("eager", "sdpa", ...), where transformers' own
    checks and the mask construction read it, while every layer's attention lookup still finds the Gaudi attention.
    The view also holds the model's generation config, whose flags are the defaults of an attention call that
    carries none: one that enters below the causal LM (TRL calls the decoder, `model.base_model`, directly).
    """

    _attn_implementation = ATTENTION_IMPLEMENTATION

    def __init__(self, config: PreTrainedConfig, model_generation_config: Any = None) -> None:
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "model_generation_config", model_generation_config)

    def __getattr__(self, name: str):
        return getattr(self.config, name)

    def __setattr__(self, name: str, value) -> None:
        if name == "model_generation_config":  # the model's generation config was replaced
            object.__setattr__(self, name, value)
        else:
            setattr(self.config, name, value)

    def __reduce__(self):
        # Pickled and deep-copied models keep a live view of their own (copied) config and generation config.
        return AttentionConfigView, (self.config, self.model_generation_config)


def model_flag_defaults(module: nn.Module) -> dict[str, bool | None]:
    """The flags a Gaudi model's generation config sets, read from the attention module's view; none elsewhere."""
    config = getattr(module, "config", None)
    return attention_flags_of(config.model_generation_config) if isinstance(config, AttentionConfigView) else {}


def register_gaudi_attention() -> None:
    """Register the attention and its mask under our names; a name without a mask function gets no mask at all."""
    for name in (ATTENTION_IMPLEMENTATION, FUSED_SDPA_IMPLEMENTATION):
        AttentionInterface.register(name, gaudi_attention_forward)
        AttentionMaskInterface.register(name, sdpa_mask)
    AttentionInterface.register(MASK_FREE_PREFILL, gaudi_attention_forward)
    AttentionMaskInterface.register(MASK_FREE_PREFILL, no_mask)


register_gaudi_attention()
