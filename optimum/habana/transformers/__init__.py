"""The Gaudi attention and the models and generation utilities built on it."""

from .attention import ATTENTION_IMPLEMENTATION, gaudi_attention_forward, matmul_softmax_attention
from .attention_flags import ATTENTION_FLAG_NAMES, AttentionFlags, resolve_attention_flags
from .generation import GaudiGenerationConfig, GaudiGenerationMixin
from .modeling_utils import adapt_transformers_to_gaudi
from .models import GaudiLlamaForCausalLM


__all__ = [
    "ATTENTION_FLAG_NAMES",
    "ATTENTION_IMPLEMENTATION",
    "AttentionFlags",
    "GaudiGenerationConfig",
    "GaudiGenerationMixin",
    "GaudiLlamaForCausalLM",
    "adapt_transformers_to_gaudi",
    "gaudi_attention_forward",
    "matmul_softmax_attention",
    "resolve_attention_flags",
]
