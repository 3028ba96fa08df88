"""What a Gaudi model's decoder prepares before its layers run, whatever called it.

The causal LM's forward is one entry point among several: TRL's SFTTrainer computes its loss from
`model.base_model(...)` (the decoder) and its own LM head, sequence-parallel trainers and feature extractors call
the decoder too. So the work that depends on the flags runs in a forward pre-hook on the decoder itself, and only
changes the call's own keyword arguments (nothing shared: a compiled graph or a second thread sees no difference):

- the flags: each one the call carries (the causal LM passes all five), else the model's default
  (`model.generation_config`, set from `attn_implementation` when one was chosen);
- with the flag, attention weights asked for by the config, and the kernel's recompute under gradient checkpointing
  (checkpointed layers run forward twice);
- the batch's layout, planned once before the layers (`batch_layout.py`): a padded prompt's real tokens, the examples
  of a padding-free packed batch, a continuous-batching step's sequences; for a sequence split over processes, the
  whole sequence's (`context_parallel/`).
"""

import inspect
from typing import Any

import torch
from torch import nn

from ..kernels.dispatch import warn_once
from .attention_flags import ATTENTION_FLAG_NAMES, attention_flags_of, check_flag_spelling, resolve_attention_flags
from .batch_layout import plan_batch_layout
from .config_view import AttentionConfigView
from .context_parallel import check_no_foreign_split


def prepare_decoder_call(
    view: AttentionConfigView, decoder: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The decoder's forward pre-hook (bound to the model's config view, which holds its generation config): the
    flags and the inputs they change, as keyword arguments."""
    if args:  # keyword arguments only from here on: the hook reads the inputs by name
        names = list(_forward_parameters(type(decoder)))[: len(args)]
        kwargs = {**dict(zip(names, args, strict=True)), **kwargs}
    if not torch.compiler.is_compiling():  # once, eagerly: a misspelled flag is named, not carried to the layers
        check_flag_spelling(kwargs)
        warn_of_flags_on_the_config(view.config)
    call_flags = {name: kwargs[name] for name in ATTENTION_FLAG_NAMES if name in kwargs}
    kwargs.update(resolve_attention_flags(call_flags, attention_flags_of(view.model_generation_config)).as_dict())
    config = decoder.config
    if kwargs["use_flash_attention"]:
        if kwargs.get("output_attentions") is None and config.output_attentions:
            kwargs["output_attentions"] = True  # the attention runs such calls on the default path, and says so
        if decoder.training and getattr(decoder, "gradient_checkpointing", False):
            kwargs["flash_attention_recompute"] = True  # the kernel must not keep intermediates for the rerun
    split = kwargs.get("context_parallel")  # a sequence split over processes: planned whole (`context_parallel/`)
    if split is None and not torch.compiler.is_compiling():
        check_no_foreign_split()
    kwargs.update(plan_batch_layout(config, kwargs, decoder.dtype) if split is None else split.plan(config, kwargs))
    return (), kwargs


def warn_of_flags_on_the_config(config: Any) -> None:
    """A flag on the model config (`config.use_flash_attention = True`, a config.json that carries one) is read by
    nothing: one warning names it and where it goes, rather than a flag that silently does nothing."""
    for name in ATTENTION_FLAG_NAMES:
        if name in vars(config):
            warn_once(
                f"config.{name}={getattr(config, name)!r} is not read: the attention flags are the generation "
                f"config's (model.generation_config.{name} = ...) or a call's (generate(), forward())."
            )


def _forward_parameters(decoder_class: type) -> tuple[str, ...]:
    parameters = tuple(inspect.signature(decoder_class.forward).parameters)
    return parameters[1:]  # without `self`


__all__ = ["prepare_decoder_call"]
