"""A generation config that carries the attention flags, saved and loaded with the rest of the config."""

from typing import Any

from transformers import GenerationConfig

from ..attention_flags import ATTENTION_FLAG_NAMES, check_flag_combination, check_flag_value


class GaudiGenerationConfig(GenerationConfig):
    """`GenerationConfig` plus the attention flags of `AttentionFlags` (each field there says what it does).

    Unset flags (None) inherit from the model's generation config, as transformers' own fields do, and are off
    when nobody sets them. The `flash_attention_*` flags require `use_flash_attention`.
    """

    def __init__(self, **kwargs: Any) -> None:
        for name in ATTENTION_FLAG_NAMES:
            setattr(self, name, kwargs.pop(name, None))
        super().__init__(**kwargs)

    @classmethod
    def from_model_config(cls, model_config: Any) -> "GaudiGenerationConfig":
        # transformers compares against a plain GenerationConfig(), which lacks our flags: convert its result.
        config = cls.from_dict(GenerationConfig.from_model_config(model_config).to_dict())
        config._original_object_hash = hash(config)
        return config

    @staticmethod
    def _get_default_generation_params() -> dict[str, Any]:
        defaults = GenerationConfig._get_default_generation_params()
        return {**defaults, **dict.fromkeys(ATTENTION_FLAG_NAMES, False)}

    def validate(self, strict: bool = False, user_set_attributes: set[str] | None = None) -> None:
        super().validate(strict=strict, user_set_attributes=user_set_attributes)
        flags = {name: getattr(self, name, None) for name in ATTENTION_FLAG_NAMES}
        for name, value in flags.items():
            check_flag_value(name, value)
        check_flag_combination(flags)
