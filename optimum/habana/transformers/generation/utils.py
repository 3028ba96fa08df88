"""The bridge that carries the attention flags from generate() to the model's forward, on every step."""

import copy
from typing import Any

from transformers import GenerationConfig

from ..attention_flags import ATTENTION_FLAG_NAMES, attention_flags_of, resolve_attention_flags


class GaudiGenerationMixin:
    """Mix into a `GenerationMixin` model whose forward names the attention flags.

    Stock generate() either rejects the flags as unused model kwargs or, once the generation config has them as
    attributes, absorbs them into the config and never passes them on. Here each flag is resolved (generate
    kwarg > the `generation_config` argument > `model.generation_config` > off) and sent to forward explicitly.
    """

    def _prepare_generation_config(
        self, generation_config: GenerationConfig | None, **kwargs: Any
    ) -> tuple[GenerationConfig, dict[str, Any]]:
        call_flags = {name: kwargs.pop(name) for name in ATTENTION_FLAG_NAMES if name in kwargs}
        flags = resolve_attention_flags(
            call_flags, attention_flags_of(generation_config), attention_flags_of(self.generation_config)
        ).as_dict()
        if generation_config is not None:
            # Resolved values first, so transformers' merge of the model's defaults cannot refill them.
            generation_config = copy.deepcopy(generation_config)
            for name, value in flags.items():
                setattr(generation_config, name, value)
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        for name, value in flags.items():
            setattr(generation_config, name, value)
        return generation_config, {**model_kwargs, **flags}
