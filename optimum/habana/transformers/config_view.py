"""The config an attention layer of a Gaudi model reads: the model's own, live, except that its attention
implementation names the Gaudi attention, and with the model's generation config beside it for the flags' defaults."""

from typing import Any

from torch import nn
from transformers import PreTrainedConfig

from .attention_flags import attention_flags_of


ATTENTION_IMPLEMENTATION = "gaudi"


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


__all__ = ["ATTENTION_IMPLEMENTATION", "AttentionConfigView", "model_flag_defaults"]
