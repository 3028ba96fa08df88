"""optimum.habana: flash attention for Llama on Intel Gaudi (HPU), CUDA and CPU, on transformers 5.

The Gaudi software (`habana_frameworks`) is optional: it is imported the first time a fused kernel runs on an HPU.
"""

from .transformers import (
    ATTENTION_FLAG_NAMES,
    AttentionFlags,
    GaudiGenerationConfig,
    GaudiLlamaForCausalLM,
    adapt_transformers_to_gaudi,
    gaudi_attention_forward,
)
from .version import __version__


__all__ = [
    "ATTENTION_FLAG_NAMES",
    "AttentionFlags",
    "GaudiGenerationConfig",
    "GaudiLlamaForCausalLM",
    "__version__",
    "adapt_transformers_to_gaudi",
    "gaudi_attention_forward",
]
