"""The Gaudi causal LMs, the list of supported families, and their registration with the Auto classes."""

from transformers import AutoModelForCausalLM

from .modeling_causal_lm import (
    GAUDI_CAUSAL_LM_CLASSES,
    GaudiGemma2ForCausalLM,
    GaudiGemma3ForCausalLM,
    GaudiGemmaForCausalLM,
    GaudiGraniteForCausalLM,
    GaudiLlamaForCausalLM,
    GaudiMistralForCausalLM,
    GaudiMixtralForCausalLM,
    GaudiOlmo2ForCausalLM,
    GaudiPhi3ForCausalLM,
    GaudiQwen2ForCausalLM,
    GaudiQwen2MoeForCausalLM,
    GaudiQwen3ForCausalLM,
    GaudiQwen3MoeForCausalLM,
    GaudiStarcoder2ForCausalLM,
)


def supported_model_types() -> tuple[str, ...]:
    """The `config.model_type` values that have a Gaudi causal LM, e.g. "llama", "qwen2_moe", "gemma3_text"."""
    return tuple(GAUDI_CAUSAL_LM_CLASSES)


def gaudi_model_class(model_type: str) -> type:
    """The Gaudi causal LM for `model_type`; a ValueError lists the supported ones."""
    try:
        return GAUDI_CAUSAL_LM_CLASSES[model_type]
    except KeyError:
        raise ValueError(
            f"optimum.habana has no Gaudi model for the model type {model_type!r}; supported: "
            f"{', '.join(supported_model_types())}."
        ) from None


def adapt_transformers_to_gaudi() -> None:
    """Make `AutoModelForCausalLM` build the Gaudi class for every supported family.

    This goes through the Auto classes' public registry; no transformers class is modified, and models built
    directly from the stock classes keep their stock attention.
    """
    for model_class in GAUDI_CAUSAL_LM_CLASSES.values():
        AutoModelForCausalLM.register(model_class.config_class, model_class, exist_ok=True)


__all__ = [
    "GAUDI_CAUSAL_LM_CLASSES",
    "GaudiGemma2ForCausalLM",
    "GaudiGemma3ForCausalLM",
    "GaudiGemmaForCausalLM",
    "GaudiGraniteForCausalLM",
    "GaudiLlamaForCausalLM",
    "GaudiMistralForCausalLM",
    "GaudiMixtralForCausalLM",
    "GaudiOlmo2ForCausalLM",
    "GaudiPhi3ForCausalLM",
    "GaudiQwen2ForCausalLM",
    "GaudiQwen2MoeForCausalLM",
    "GaudiQwen3ForCausalLM",
    "GaudiQwen3MoeForCausalLM",
    "GaudiStarcoder2ForCausalLM",
    "adapt_transformers_to_gaudi",
    "gaudi_model_class",
    "supported_model_types",
]
