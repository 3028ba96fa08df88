"""The Gaudi attention: one function that transformers' attention interface calls for every layer of every family.

With `use_flash_attention` it runs the fused kernel of the device (`optimum.habana.kernels`); otherwise, or when
no fused kernel can honour the call (soft-capped logits, or inputs the device's kernel rejects), the explicit
matmul-softmax attention. It is registered under the names "gaudi" and "gaudi_fused_sdpa" together with
transformers' SDPA mask function, so any model family that looks its attention up through
`ALL_ATTENTION_FUNCTIONS` can use it by setting `attn_implementation="gaudi"`.

The mask contract (from `transformers.masking_utils`): a boolean `[B, 1, q, kv]` mask (True = attend) or an
additive float mask, or None when causality alone is exact: "causal, top-left aligned" for q > 1, "no mask" for
q == 1. Sliding windows are part of the mask, so both paths honour them by reading it. A Gaudi model's decoder
replaces the masks that would cost O(N^2) on the fused path by a plan (`batch_layout.py`): a padded prompt's real
tokens, the sequences of a packed batch or of a continuous-batching step; every layer then runs without reading a
tensor on the host, so the model traces into one graph.
"""

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils.generic import TransformersKwargs

from ..kernels.dispatch import FusedSDPAUnavailable, fused_sdpa, warn_once
from ..kernels.variable_length import (
    PaddedPrompt,
    Segment,
    Segments,
    padded_causal_sdpa,
    segment_mask,
    segmented_sdpa,
)
from .attention_flags import DEFAULT_PATH_FLAGS, AttentionFlags, attention_flags_of, call_attention_flags
from .batch_layout import paged_segments


ATTENTION_IMPLEMENTATION = "gaudi"
# Optimum-Habana's name for the fused attention; registered as the same function.
FUSED_SDPA_IMPLEMENTATION = "gaudi_fused_sdpa"

# Keywords that reach every attention function and need nothing here: the model or the mask has already used them
# (positions, packed-sequence boundaries, caching), they switch model-level outputs, or they are the loss's, which
# a stock forward hands down with everything else (`shift_labels` in sequence-parallel training). transformers'
# own list (`TransformersKwargs`) is read, so a keyword it adds is known here too. Any other keyword is an error,
# so that a family feature is never dropped silently.
IGNORED_ATTENTION_KWARGS = (
    frozenset(TransformersKwargs.__annotations__) - {"output_attentions", "is_causal"}  # both read below
) | {"cache_position", "use_cache", "shift_labels", "ignore_index"}
# What transformers' continuous batching passes besides its paged cache: the cache reads them in `update`, the
# engine reads the logits ones; the step's sequences come from `cu_seq_lens_q`/`cu_seq_lens_k` (or its mask).
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
    padded_prompt: PaddedPrompt | None = None,
    segments: Segments | None = None,
    segment_bounds: tuple[Segment, ...] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention for query `[B, H, q, D]` and key/value `[B, Hkv, kv, D]`; returns `([B, q, H, D], weights)`.

    The flags arrive as keyword arguments from the model's forward, the batch's layout from the decoder's plan
    (`batch_layout`): `padded_prompt` for a padded prompt that runs causally over its real tokens (then the mask is
    only the `[B, 1, 1, kv]` real keys, or transformers' own where a sliding window needs it), `segments` for a
    padding-free packed batch, `segment_bounds` for a continuous-batching step planned on the host.
    Weights are returned by the default path only: the fused kernel never materialises them.
    """
    flags = call_attention_flags(kwargs, model_flag_defaults(module))
    cache = kwargs.pop("cache", None)
    if isinstance(cache, PagedAttentionCache):  # continuous batching: the layer writes and reads its paged cache
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
        if attention_mask is None and sliding_window is None:  # the engine built no mask: the flag's step
            segments = paged_step_segments(kwargs, query.shape[2], key.shape[2], segment_bounds)
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
    if segments is not None:
        key, value = key[:, :, : segments.key_ids.shape[1]], value[:, :, : segments.key_ids.shape[1]]
    if padded_prompt is not None and sliding_window is not None and query.shape[2] > sliding_window:
        # The window lives in transformers' mask, which this layer keeps (only windowless models go mask-free).
        if flags.use_flash_attention and flags.flash_attention_causal_mask:
            warn_once(
                f"flash_attention_causal_mask: {type(module).__name__} attends within a sliding window of "
                f"{sliding_window} tokens, shorter than this prompt ({query.shape[2]}); its layers read the mask to "
                "keep the window."
            )
        padded_prompt = None
    if flags.use_flash_attention:
        for name in DEFAULT_PATH_FLAGS:
            if getattr(flags, name):
                warn_once(
                    f"{name} with use_flash_attention: the fused kernel computes its own softmax, so {name} applies "
                    "only to the calls that take the default path (soft-capped logits, attention weights asked for)."
                )
        reason = fused_path_refusal(module, softcap, output_attentions)
        if reason is None:
            try:
                output = flash_attention(
                    module, query, key, value, attention_mask, scaling, dropout, flags, sliding_window, is_causal,
                    padded_prompt, segments,
                )  # fmt: skip
                return output.transpose(1, 2).contiguous(), None
            except FusedSDPAUnavailable as error:
                reason = str(error)
        warn_once(f"use_flash_attention: {reason}. Running the default attention instead; results are unchanged.")
    if segments is not None:
        attention_mask = segment_mask(segments, sliding_window)
    elif padded_prompt is not None and (attention_mask is None or attention_mask.shape[-2] == 1):
        attention_mask = prompt_mask(padded_prompt, key.shape[2])  # the real keys only: add causality
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


def paged_step_segments(
    kwargs: dict[str, Any], query_length: int, key_length: int, bounds: tuple[Segment, ...] | None
) -> Segments | None:
    """The sequences of a continuous-batching step: planned on the host, or as tensors from the engine's boundaries."""
    cu_seq_lens_q, cu_seq_lens_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if isinstance(cu_seq_lens_k, dict):  # before the paged cache's update, keyed by layer type
        cu_seq_lens_k = cu_seq_lens_k.get("full_attention")
    if not isinstance(cu_seq_lens_q, torch.Tensor) or not isinstance(cu_seq_lens_k, torch.Tensor):
        return None
    segments = paged_segments(cu_seq_lens_q, cu_seq_lens_k, query_length, key_length)
    return segments._replace(bounds=bounds)


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
    padded_prompt: PaddedPrompt | None,
    segments: Segments | None,
) -> torch.Tensor:
    """Choose the kernel and its arguments for this call; returns `[B, H, q, D]`."""
    is_prefill = query.shape[2] > 1
    dropout = dropout if module.training else 0.0
    # Recomputation trades compute for memory where there is memory to save: prefill and training.
    recompute = flags.flash_attention_recompute and (is_prefill or module.training)
    if segments is not None:
        return segmented_sdpa(
            query,
            key,
            value,
            segments,
            scale=scaling,
            dropout_p=dropout,
            fast_softmax=flags.flash_attention_fast_softmax,
            recompute=flags.flash_attention_recompute,
            sliding_window=sliding_window,
        )
    # The fast softmax pays off on long prompts only; decode stays exact (it cost throughput there).
    softmax_mode = "fast" if flags.flash_attention_fast_softmax and is_prefill else "None"
    options = {"scale": scaling, "dropout_p": dropout, "softmax_mode": softmax_mode, "recompute": recompute}
    if padded_prompt is not None:
        return padded_causal_sdpa(query, key, value, padded_prompt, **options)
    if attention_mask is None and is_prefill and is_causal is not False:
        # Causal prefill from an empty cache: a static cache's unused slots lie past the prompt, drop them.
        q_len = query.shape[2]
        return fused_sdpa(query, key[:, :, :q_len], value[:, :, :q_len], None, is_causal=True, **options)
    output = fused_sdpa(query, key, value, attention_mask, is_causal=False, **options)
    masked = fully_masked_queries(attention_mask)
    return output if masked is None else output.masked_fill(masked, 0.0)


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
    Grouped-query attention stacks each key/value head's query group as rows, `[B, Hkv, groups * q, D]`: one
    matrix product per key/value head reads its keys and values once, never repeated nor broadcast (a broadcast
    product copies them once per group).
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scaling = head_dim**-0.5 if scaling is None else scaling
    grouped_query = query.reshape(batch, kv_heads, groups * q_len, head_dim)

    scores = torch.matmul(grouped_query, key.transpose(-1, -2)).view(batch, kv_heads, groups, q_len, kv_len) * scaling
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
    output = torch.matmul(weights.view(batch, kv_heads, groups * q_len, kv_len), value)
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


def prompt_mask(prompt: PaddedPrompt, key_length: int) -> torch.Tensor:
    """The boolean `[B, 1, q, kv]` mask transformers builds for a padded prompt: causal, over the real keys."""
    q_len = prompt.real.shape[1]
    positions = torch.arange(key_length, device=prompt.real.device)
    causal = positions[None, :] <= positions[:q_len, None]
    real_keys = torch.nn.functional.pad(prompt.real, (0, key_length - q_len))  # a static cache's empty slots
    return (causal[None] & real_keys[:, None, :])[:, None]


def causal_padding_mask(valid_sequence_lengths: torch.Tensor, q_len: int, padding_side: str) -> torch.Tensor:
    """The boolean `[B, 1, q, q]` mask of a causal prefill whose rows hold `valid_sequence_lengths` real tokens."""
    positions = torch.arange(q_len, device=valid_sequence_lengths.device)
    if padding_side == "left":
        real = positions >= (q_len - valid_sequence_lengths)[:, None]
    else:
        real = positions < valid_sequence_lengths[:, None]
    causal = positions[None, :] <= positions[:, None]
    return (causal[None] & real[:, None, :])[:, None]


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


register_gaudi_attention()
