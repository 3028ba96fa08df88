"""optimum.habana: flash attention for transformers' causal LMs on Intel Gaudi (HPU), CUDA and CPU.

`supported_model_types()` lists the families with a Gaudi class; `adapt_transformers_to_gaudi()` makes
`AutoModelForCausalLM` build them. The Gaudi software (`habana_frameworks`) is optional: it is imported the first
time a fused kernel runs on an HPU. The installed transformers is checked before anything imports it
(`utils.requirements`): outside the tested range, the import stops with one line that says what to install.
"""

from .utils.requirements import check_environment


check_environment()

from .transformers import (  # noqa: E402  (after the check: a transformers outside the range fails in here)
    ATTENTION_FLAG_NAMES,
    AttentionFlags,
    GaudiAttentionMixin,
    GaudiGemma2ForCausalLM,
    GaudiGemma3ForCausalLM,
    GaudiGemmaForCausalLM,
    GaudiGenerationConfig,
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
    adapt_transformers_to_gaudi,
    gaudi_attention_forward,
    gaudi_model_class,
    supported_model_types,
)
from .version import __version__  # noqa: E402


__all__ = [
    "ATTENTION_FLAG_NAMES",
    "AttentionFlags",
    "GaudiAttentionMixin",
    "GaudiGemma2ForCausalLM",
    "GaudiGemma3ForCausalLM",
    "GaudiGemmaForCausalLM",
    "GaudiGenerationConfig",
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
    "__version__",
    "adapt_transformers_to_gaudi",
    "gaudi_attention_forward",
    "gaudi_model_class",
    "supported_model_types",
]
