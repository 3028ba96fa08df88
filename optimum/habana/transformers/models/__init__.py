"""The Gaudi causal LMs: the 14 written classes, and one made from transformers' own class for every other family
whose attention qualifies (`registry`; the rules are `families/qualification.py`)."""

from ..families.qualification import FamilyReport
from ..families.reports import family_report
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
from .registry import (
    adapt_transformers_to_gaudi,
    family_problem,
    family_table,
    gaudi_model_class,
    supported_model_types,
)


__all__ = [
    "GAUDI_CAUSAL_LM_CLASSES",
    "FamilyReport",
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
    "family_problem",
    "family_report",
    "family_table",
    "gaudi_model_class",
    "supported_model_types",
]
