"""What a Gaudi model's decoder prepares before its layers run, whatever called it.

The causal LM's forward is one entry point among several: TRL's SFTTrainer computes its loss from
`model.base_model(...)` (the decoder) and its own LM head, sequence-parallel trainers and feature extractors call
the decoder too. So the work that depends on the flags runs in a forward pre-hook on the decoder itself
(`prepare_decoder_call`), and a forward hook that always runs, even after an error, undoes what must not outlive
the call (`finish_decoder_call`):

- the flags: those the call carries (the causal LM passes all five), else the model's defaults
  (`model.generation_config`, set from `attn_implementation` when one was chosen), resolved per flag;
- with the flag, attention weights asked for by the config, and the kernel's recompute under gradient checkpointing
  (checkpointed layers run forward twice);
- padding-free packed batches: their example lengths, read once per forward (`packing.py`);
- a padded prompt that needs nothing but causality and its padding: per-row valid lengths instead of transformers'
  `[B, 1, q, q]` mask, which is then not built (its name is swapped for the call, `mask_free_prefill`).
"""

import inspect
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from ..kernels.dispatch import needs_padding_mask
from .attention import MASK_FREE_PREFILL, AttentionConfigView
from .attention_flags import ATTENTION_FLAG_NAMES, attention_flags_of, resolve_attention_flags
from .packing import can_run_packed, packed_sequence_lengths


def prepare_decoder_call(
    view: AttentionConfigView, decoder: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The decoder's forward pre-hook (bound to the model's config view, which holds its generation config): the
    flags and the inputs they change, as keyword arguments."""
    if args:  # keyword arguments only from here on: the hook reads the inputs by name
        names = list(_forward_parameters(type(decoder)))[: len(args)]
        kwargs = {**dict(zip(names, args, strict=True)), **kwargs}
    if not any(name in kwargs for name in ATTENTION_FLAG_NAMES):
        kwargs.update(resolve_attention_flags(attention_flags_of(view.model_generation_config)).as_dict())
    config = decoder.config
    if kwargs["use_flash_attention"]:
        if kwargs.get("output_attentions") is None and config.output_attentions:
            kwargs["output_attentions"] = True  # the attention runs such calls on the default path, and says so
        if decoder.training and getattr(decoder, "gradient_checkpointing", False):
            kwargs["flash_attention_recompute"] = True  # the kernel must not keep intermediates for the rerun
    input_ids, inputs_embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    attention_mask, past_key_values = kwargs.get("attention_mask"), kwargs.get("past_key_values")
    tokens = input_ids if input_ids is not None else inputs_embeds
    packed = None
    if tokens is not None and can_run_packed(config):
        packed = packed_sequence_lengths(kwargs.get("position_ids"), attention_mask, past_key_values, tokens, kwargs)
    if packed is not None:
        # Padding-free packing, flag or not: the attention isolates the examples, transformers builds no mask.
        kwargs["packed_sequence_lengths"] = packed
        mask_free = True
    elif kwargs["use_flash_attention"] and tokens is not None:
        # A padded prompt whose layers need nothing but causality and the padding skips transformers' mask,
        # unless the device's kernel reads it (Gaudi without the causal-mask mode).
        causal_mask_mode = kwargs["flash_attention_causal_mask"]
        mask_free = padding_mask_is_all_it_needs(config) and not needs_padding_mask(tokens, causal_mask_mode)
        if causal_mask_mode or mask_free:
            padding = causal_prefill_padding(attention_mask, input_ids, inputs_embeds, past_key_values)
            kwargs.update(padding)
            mask_free = mask_free and bool(padding)
    else:
        mask_free = False
    if mask_free:
        decoder.gaudi_chosen_attention = config._attn_implementation_internal
        config._attn_implementation_internal = MASK_FREE_PREFILL
    return (), kwargs


def finish_decoder_call(decoder: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
    """The decoder's forward hook, run even when the forward raised: the user's attention choice comes back."""
    chosen = decoder.__dict__.pop("gaudi_chosen_attention", None)
    if chosen is not None:
        decoder.config._attn_implementation_internal = chosen


def _forward_parameters(decoder_class: type) -> tuple[str, ...]:
    parameters = tuple(inspect.signature(decoder_class.forward).parameters)
    return parameters[1:]  # without `self`


def padding_mask_is_all_it_needs(config: PreTrainedConfig) -> bool:
    """Whether every layer's mask is causal plus padding: no sliding window, no bidirectional or chunked layers."""
    if not getattr(config, "is_causal", True) or getattr(config, "attention_chunk_size", None):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(layer_type == "full_attention" for layer_type in layer_types)
    return getattr(config, "sliding_window", None) is None


def causal_prefill_padding(
    attention_mask: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    past_key_values: Cache | None,
) -> dict[str, Any]:
    """Per-row valid lengths for a prefill from an empty cache, when the padding is all on one side.

    Returns `{"valid_sequence_lengths": int32 [B], "padding_side": ...}`, or nothing when the mask is needed
    (decode, a non-empty cache, padding on both sides or in the middle): the attention then reads the mask.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return {}  # None, a prepared 4-D mask, or a dict of masks per layer type: the attention reads those
    q_len = (input_ids if input_ids is not None else inputs_embeds).shape[1]
    past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
    if q_len == 1 or past_len != 0 or attention_mask.shape[1] != q_len:
        return {}
    real = attention_mask.bool()
    # int32: the Gaudi kernel requires it, and torch.compile traces it without recompiling.
    lengths = real.sum(dim=-1, dtype=torch.int32)
    positions = torch.arange(q_len, device=real.device)
    if torch.equal(real, positions >= (q_len - lengths)[:, None]):
        return {"valid_sequence_lengths": lengths, "padding_side": "left"}
    if torch.equal(real, positions < lengths[:, None]):
        return {"valid_sequence_lengths": lengths, "padding_side": "right"}
    return {}


__all__ = ["causal_prefill_padding", "finish_decoder_call", "padding_mask_is_all_it_needs", "prepare_decoder_call"]
