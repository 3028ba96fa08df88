"""The Gaudi attention and the models and generation utilities built on it."""

from .attention import gaudi_attention_forward, matmul_softmax_attention
from .attention_flags import ATTENTION_FLAG_NAMES, AttentionFlags, resolve_attention_flags
from .config_view import ATTENTION_IMPLEMENTATION
from .generation import GaudiGenerationConfig, GaudiGenerationMixin
from .modeling_utils import ATTENTION_IMPLEMENTATIONS, GaudiAttentionMixin
from .models import (
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
    adapt_transformers_to_gaudi,
    gaudi_model_class,
    supported_model_types,
)
from .registration import register_gaudi_attention


__all__ = [
    "ATTENTION_FLAG_NAMES",
    "ATTENTION_IMPLEMENTATION",
    "ATTENTION_IMPLEMENTATIONS",
    "AttentionFlags",
    "GaudiAttentionMixin",
    "GaudiGemma2ForCausalLM",
    "GaudiGemma3ForCausalLM",
    "GaudiGemmaForCausalLM",
    "GaudiGenerationConfig",
    "GaudiGenerationMixin",
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
    "gaudi_attention_forward",
    "gaudi_model_class",
    "matmul_softmax_attention",
    "register_gaudi_attention",
    "resolve_attention_flags",
    "supported_model_types",
]
