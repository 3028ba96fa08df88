"""The Gaudi attention: one function that transformers' attention interface calls for every layer of every family.

With `use_flash_attention` it runs the fused kernel of the device (`optimum.habana.kernels`); otherwise, or when
no fused kernel can honour the call (soft-capped logits, or inputs the device's kernel rejects), the explicit
matmul-softmax attention. `registration.py` registers it under the names "gaudi" and "gaudi_fused_sdpa".

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
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.utils.generic import TransformersKwargs

from ..kernels.dispatch import (
    FusedSDPAUnavailable,
    fully_masked_queries,
    fused_sdpa,
    warn_once,
    weights_for_value_product,
)
from ..kernels.latent import absorbed_latent_sdpa
from ..kernels.sinks import sink_weight_column
from ..kernels.variable_length import (
    PaddedPrompt,
    Segment,
    Segments,
    padded_causal_sdpa,
    segmented_sdpa,
)
from .attention_flags import DEFAULT_PATH_FLAGS, AttentionFlags, call_attention_flags
from .batch_layout import paged_segments
from .config_view import AttentionConfigView, model_flag_defaults  # noqa: F401  (the view: pickles made before it moved)
from .families.lookups import family_is_windowed
from .latent_attention import absorbable_up_projection, expanded, receives_compressed_latent
from .paged_attention import check_cache_geometry, paged_step_in_place
from .planned_masks import blocked_float_rows_attend, is_real_keys_only, planned_mask, prompt_mask, scored_mask


# Optimum-Habana's name for the fused attention; registered as the same function.
FUSED_SDPA_IMPLEMENTATION = "gaudi_fused_sdpa"

# Keywords that reach every attention function and need nothing here: the model or the mask has already used them
# (positions, packed-sequence boundaries, caching), they switch model-level outputs, or they are the loss's, which
# a stock forward hands down with everything else (`shift_labels` in sequence-parallel training). transformers'
# own list (`TransformersKwargs`) is read, so a keyword it adds is known here too. Any other keyword is an error,
# so that a family feature is never dropped silently.
IGNORED_ATTENTION_KWARGS = (
    (frozenset(TransformersKwargs.__annotations__) - {"output_attentions", "is_causal"})  # both read below
    | {"cache_position", "use_cache", "shift_labels", "ignore_index"}
    # generate()'s own bookkeeping for `prepare_inputs_for_generation`, which reaches forward where a subclass's
    # override hands every keyword on (`inputs.update(kwargs)`); stock's attention functions ignore them too
    | {"is_first_iteration", "next_sequence_length"}
)
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
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention transformers' interface calls (`attention_forward`). Latent attention's layers in a Gaudi model
    hand over their compressed cache instead of keys and values (`latent_attention.py`): a step that absorbs the
    up-projection attends over it as it lies; any other call gets the family's own expansion first."""
    if receives_compressed_latent(module):
        output = absorbed_latent_attention(module, query, key, value, attention_mask, kwargs)
        if output is not None:
            return output, None
        key, value = expanded(module, key, value)
    return attention_forward(module, query, key, value, attention_mask, **kwargs)


def attention_forward(
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
    A call with `context_parallel` (a `SequenceSplit`) holds this process's positions of a sequence split over
    processes: it runs over the whole sequence for this process's heads (`context_parallel/`).
    """
    split = kwargs.pop("context_parallel", None)
    if split is not None:
        return split.attend(
            attention_forward, module, query, key, value, attention_mask,
            scaling=scaling, dropout=dropout, sliding_window=sliding_window, softcap=softcap, is_causal=is_causal,
            output_attentions=output_attentions, padded_prompt=padded_prompt, segments=segments,
            segment_bounds=segment_bounds, **kwargs,
        )  # fmt: skip
    flags = call_attention_flags(kwargs, model_flag_defaults(module))
    cache = kwargs.pop("cache", None)
    paged_cache = cache if isinstance(cache, PagedAttentionCache) else None
    engine_kwargs = {}
    if paged_cache is not None:  # the engine's arguments for its cache, read below
        engine_kwargs = {name: kwargs.pop(name) for name in CONTINUOUS_BATCHING_KWARGS if name in kwargs}
    elif cache is not None:
        kwargs["cache"] = cache  # named among the unknown arguments below
    sinks = pop_sinks(kwargs)
    position_bias, selected_keys = kwargs.pop("position_bias", None), kwargs.pop("indices", None)
    unknown = set(kwargs) - IGNORED_ATTENTION_KWARGS
    if unknown:
        raise TypeError(
            f"The Gaudi attention does not know the argument(s) {sorted(unknown)} that {type(module).__name__} passes, "
            "so it cannot honour them: a keyword argument given to the model's forward that nothing takes (check its "
            "spelling), or one the family computes with that the Gaudi attention does not "
            "(`python -m optimum.habana.families` says which families qualify)."
        )
    decode_rows = False
    if paged_cache is not None:  # continuous batching: the layer writes and reads its paged cache
        check_cache_geometry(module, key, value, paged_cache)
        cache_kwargs = {**kwargs, **engine_kwargs}  # what the cache reads (and rewrites: cu_seq_lens_k per layer kind)
        mask_free = attention_mask is None and sliding_window is None  # the engine built no mask: the flag's step
        # The decoder plans the step's sequences where a layer may run them without the engine's mask: every layer
        # when the engine built none, and the full-attention layers beside sliding-window ones (their mask is each
        # sequence's causal mask, which the bounds give).
        if (
            segment_bounds is not None
            and sliding_window is None
            and flags.use_flash_attention
            and (sinks is None or sinks.dim() == 1)  # one logit per head: the paged entry's softmax takes it
            and position_bias is None
            and selected_keys is None
            and fused_path_refusal(module, softcap, output_attentions) is None
            and local_extent(module, None, query.shape[2]) == (None, None)
        ):
            output = paged_step_in_place(
                module, query, key, value, paged_cache, cache_kwargs, segment_bounds,
                scale=scaling, fast_softmax=flags.flash_attention_fast_softmax,
                recompute=flags.flash_attention_recompute, sinks=sinks,
            )  # fmt: skip
            if output is not None:
                warn_about_default_path_flags(flags)
                return output.transpose(1, 2).contiguous(), None
        key, value = paged_cache.update(
            key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=cache_kwargs
        )
        if mask_free:
            segments = paged_step_segments(cache_kwargs, query.shape[2], key.shape[2], segment_bounds)
        # A step whose sequences each add one token decodes them side by side: its rows are decode steps (shapes only).
        cu_seq_lens_q = cache_kwargs.get("cu_seq_lens_q")
        decode_rows = isinstance(cu_seq_lens_q, torch.Tensor) and cu_seq_lens_q.shape[0] - 1 == query.shape[2]
    if segments is not None:
        key, value = key[:, :, : segments.key_ids.shape[1]], value[:, :, : segments.key_ids.shape[1]]
    per_row_sinks = sinks is not None and sinks.dim() > 1
    floor_attends = blocked_float_rows_attend(module, position_bias is not None or selected_keys is not None)
    if position_bias is not None or selected_keys is not None or (per_row_sinks and (padded_prompt or segments)):
        # A bias per score, the keys an indexer selected per query, or sinks per row: the family's own attention
        # reads them as a dense mask, and so do both paths here (the plan's layout becomes that mask).
        attention_mask = planned_mask(attention_mask, padded_prompt, segments, sliding_window, key.shape[2])
        attention_mask = scored_mask(attention_mask, query, key, is_causal, position_bias, selected_keys)
        padded_prompt = segments = None
    window, chunk = local_extent(module, sliding_window, query.shape[2])
    padding_queries = None  # a planned prompt's padding rows, zero on the fused path whichever way it runs
    if padded_prompt is not None and (window or chunk):
        if not is_real_keys_only(attention_mask):  # transformers' own mask reached the layer: it keeps the window
            if flags.use_flash_attention and flags.flash_attention_causal_mask:
                extent, kept = (
                    (f"a sliding window of {window}", "window") if window else (f"chunks of {chunk}", "chunks")
                )
                warn_once(
                    f"flash_attention_causal_mask: {type(module).__name__} attends within {extent} tokens, shorter "
                    f"than this prompt ({query.shape[2]}); its layers read the mask to keep the {kept}."
                )
            padded_prompt = None
        elif padded_prompt.side == "any":  # padding in the middle: the window counts it, as transformers does
            attention_mask = prompt_mask(padded_prompt, key.shape[2], window, chunk)
            # zero, as on the other padded paths, but at the last position of a row that ends in padding, where
            # generate() continues: stock's attention there, from the mask, unless no real key is in reach
            padding_queries = ~padded_prompt.real[:, None, :, None]
            padding_queries[:, :, -1] = ~attention_mask[:, :, -1].any(dim=-1, keepdim=True)
            padded_prompt = None
    if flags.use_flash_attention:
        warn_about_default_path_flags(flags)
        reason = fused_path_refusal(module, softcap, output_attentions)
        if reason is None:
            try:
                output = flash_attention(
                    module, query, key, value, attention_mask, scaling, dropout, flags, sliding_window, is_causal,
                    padded_prompt, segments, sinks, (window, chunk), decode_rows, floor_attends,
                )  # fmt: skip
                if padding_queries is not None:
                    output = output.masked_fill(padding_queries, 0.0)
                return output.transpose(1, 2).contiguous(), None
            except FusedSDPAUnavailable as error:
                reason = str(error)
        warn_once(f"use_flash_attention: {reason}. Running the default attention instead; results are unchanged.")
    attention_mask = planned_mask(attention_mask, padded_prompt, segments, window, key.shape[2], chunk)
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
        sinks=sinks,
        floor_attends=floor_attends,
    )


# Arguments a call may carry that an absorbed latent step has no use for: it takes the general path where any has a
# value (a plan, the engine's cache, a split over processes, a bias, a cap, weights asked for, a window).
GENERAL_PATH_KWARGS = frozenset(
    {
        "context_parallel", "cache", "padded_prompt", "segments", "segment_bounds", "position_bias", "softcap",
        "output_attentions", "sliding_window",
    }
)  # fmt: skip


def absorbed_latent_attention(
    module: nn.Module,
    query: torch.Tensor,
    latent: torch.Tensor,
    rotary_key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> torch.Tensor | None:
    """With the flag, an inference call of latent attention with a few query rows (decode steps), over its compressed
    cache (`kernels/latent.py`): nothing as long as the context is expanded or copied. None where the call takes the
    general path: without the flag (the default path is stock's expansion), in training (the fused kernels' backward
    and recompute), for a prompt with the fused kernel's prompt companions (recompute, fast softmax), with anything
    in `GENERAL_PATH_KWARGS`, or where absorbing is not exact or cheaper (`absorbable_up_projection`). Returns
    `[B, q, H, v]`."""
    call = dict(kwargs)
    flags = call_attention_flags(call, model_flag_defaults(module))
    scaling = call.pop("scaling", None)
    call.pop("dropout", None)  # inference only: no dropout
    is_causal, selected_keys = call.pop("is_causal", None), call.pop("indices", None)
    sinks = pop_sinks(call)
    if module.training or not flags.use_flash_attention or set(call) - IGNORED_ATTENTION_KWARGS - GENERAL_PATH_KWARGS:
        return None  # an unknown argument: the general path names it
    if any(call.get(name) is not None and call.get(name) is not False for name in GENERAL_PATH_KWARGS):
        return None
    if query.shape[2] > 1 and (flags.flash_attention_recompute or flags.flash_attention_fast_softmax):
        return None  # a prompt with the companions that act on the fused kernel: that kernel runs it
    up_projection = absorbable_up_projection(module, query, latent)
    if up_projection is None or local_extent(module, None, query.shape[2]) != (None, None):
        return None
    warn_about_default_path_flags(flags)
    mask = scored_mask(attention_mask, query, latent, is_causal, None, selected_keys)
    output = absorbed_latent_sdpa(
        query, latent, rotary_key, up_projection, mask,
        scale=query.shape[-1] ** -0.5 if scaling is None else scaling,
        sinks=sinks, floor_attends=blocked_float_rows_attend(module, selected_keys is not None),
    )  # fmt: skip
    return output.transpose(1, 2).contiguous()


def pop_sinks(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The call's sinks: gpt-oss's name for them is `s_aux`, other families say `sinks`."""
    sinks = kwargs.pop("s_aux", None)
    return kwargs.pop("sinks", None) if sinks is None else sinks


def warn_about_default_path_flags(flags: AttentionFlags) -> None:
    """One warning for each flag of the default path set with use_flash_attention, whose calls it never reaches."""
    for name in DEFAULT_PATH_FLAGS:
        if getattr(flags, name):
            warn_once(
                f"{name} with use_flash_attention: the fused kernel computes its own softmax, so {name} applies "
                "only to the calls that take the default path (soft-capped logits, attention weights asked for)."
            )


def local_extent(module: nn.Module, sliding_window: int | None, q_len: int) -> tuple[int | None, int | None]:
    """The layer's sliding window or chunk when this call's queries reach past it, else (None, None).

    The window comes as the family passes it, or, like the chunk, from transformers' own convention for local layers
    (`config.layer_types[layer_idx]` with `config.sliding_window` or `config.attention_chunk_size`), which its masks
    follow; a family without layer kinds whose mask builder windows by the config alone (PhiMoE) has
    `config.sliding_window` on every layer. One query (a decode step) reaches past no window or chunk: the config is
    not read (its attributes cost microseconds a read, on every layer of every step)."""
    if q_len <= 1:
        return None, None
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None) or ()
    layer_index = getattr(module, "layer_idx", None)
    kind = layer_types[layer_index] if isinstance(layer_index, int) and layer_index < len(layer_types) else None
    windowed_by_config = not layer_types and config is not None and family_is_windowed(config.model_type)
    if sliding_window is None and (kind == "sliding_attention" or windowed_by_config):
        sliding_window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None) if kind == "chunked_attention" else None
    window = sliding_window if isinstance(sliding_window, int) and q_len > sliding_window else None
    return window, chunk if isinstance(chunk, int) and q_len > chunk else None


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
    sinks: torch.Tensor | None = None,
    local: tuple[int | None, int | None] = (None, None),
    decode_rows: bool = False,
    floor_attends: bool = False,
) -> torch.Tensor:
    """Choose the kernel and its arguments for this call; returns `[B, H, q, Dv]`. `local`: the layer's window and
    chunk, for a planned prompt longer than them. `decode_rows`: a continuous-batching step of one new token per
    sequence, whose query rows are decode steps (a step with a prompt chunk among them is a prefill: the kernel takes
    one softmax mode per call). `floor_attends`: `planned_masks.blocked_float_rows_attend`."""
    is_prefill = query.shape[2] > 1 and not decode_rows
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
            sinks=sinks,
        )
    # The fast softmax pays off on long prompts only; decode stays exact (it cost throughput there).
    softmax_mode = "fast" if flags.flash_attention_fast_softmax and is_prefill else "None"
    options = {
        "scale": scaling,
        "dropout_p": dropout,
        "softmax_mode": softmax_mode,
        "recompute": recompute,
        "sinks": sinks,
    }
    if padded_prompt is not None:
        window, chunk = local
        return padded_causal_sdpa(query, key, value, padded_prompt, window=window, chunk=chunk, **options)
    if attention_mask is None and is_prefill and is_causal is not False:
        # Causal prefill from an empty cache: a static cache's unused slots lie past the prompt, drop them.
        q_len = query.shape[2]
        return fused_sdpa(query, key[:, :, :q_len], value[:, :, :q_len], None, is_causal=True, **options)
    output = fused_sdpa(query, key, value, attention_mask, is_causal=False, **options)
    masked = fully_masked_queries(attention_mask, floor_attends)
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
    sinks: torch.Tensor | None = None,
    floor_attends: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The default path: `softmax(cap(Q Kᵀ * scale) + mask) V`, with the full score matrix.

    `softcap` bounds the logits as `softcap * tanh(logits / softcap)` before the mask, as Gemma 2 trains with.
    `sinks` join each row's softmax as a last column that is then dropped (the weights returned leave them out).
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
        if attention_mask.dim() == 4 and attention_mask.shape[1] == heads > 1:  # one mask per head: group them
            attention_mask = attention_mask.unflatten(1, (kv_heads, groups))
        elif attention_mask.dim() == 4:
            attention_mask = attention_mask.unsqueeze(2)  # [B, 1, q, kv] -> broadcast over the groups
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask

    if sinks is not None:
        scores = sink_weight_column(scores, sinks)
    probabilities = nn.functional.softmax(scores, dim=-1, dtype=softmax_dtype).to(query.dtype)
    if sinks is not None:
        probabilities = probabilities[..., :-1]
    masked = fully_masked_queries(attention_mask, floor_attends)
    if masked is not None:
        probabilities = probabilities.masked_fill(masked, 0.0)
    probabilities = nn.functional.dropout(probabilities, p=dropout, training=dropout > 0.0)
    # The weights returned are the tensor the output is computed from: a caller's retain_grad() on them sees grads.
    weights = probabilities.view(batch, heads, q_len, kv_len)
    output = torch.matmul(weights_for_value_product(weights.view(batch, kv_heads, groups * q_len, kv_len)), value)
    output = output.view(batch, heads, q_len, -1).transpose(1, 2).contiguous()
    return output, weights
