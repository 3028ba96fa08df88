"""The Gaudi causal LMs: transformers' own classes with `GaudiAttentionMixin` in front, one per supported family.

A family qualifies when its attention layers look their function up in `ALL_ATTENTION_FUNCTIONS` and every
keyword they pass to it is one the Gaudi attention honours (docs/attention.md, "Adding a family").
"""

from transformers import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    GemmaForCausalLM,
    GraniteForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    Olmo2ForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    Starcoder2ForCausalLM,
)

from ..modeling_utils import GaudiAttentionMixin


class GaudiLlamaForCausalLM(GaudiAttentionMixin, LlamaForCausalLM):
    """`LlamaForCausalLM` with the Gaudi attention and its flags."""


class GaudiMistralForCausalLM(GaudiAttentionMixin, MistralForCausalLM):
    """`MistralForCausalLM` with the Gaudi attention; its sliding window is honoured through the mask."""


class GaudiMixtralForCausalLM(GaudiAttentionMixin, MixtralForCausalLM):
    """`MixtralForCausalLM` with the Gaudi attention."""


class GaudiQwen2ForCausalLM(GaudiAttentionMixin, Qwen2ForCausalLM):
    """`Qwen2ForCausalLM` with the Gaudi attention; sliding-window layers are honoured through the mask."""


class GaudiQwen2MoeForCausalLM(GaudiAttentionMixin, Qwen2MoeForCausalLM):
    """`Qwen2MoeForCausalLM` with the Gaudi attention."""


class GaudiQwen3ForCausalLM(GaudiAttentionMixin, Qwen3ForCausalLM):
    """`Qwen3ForCausalLM` with the Gaudi attention."""


class GaudiQwen3MoeForCausalLM(GaudiAttentionMixin, Qwen3MoeForCausalLM):
    """`Qwen3MoeForCausalLM` with the Gaudi attention."""


class GaudiGemmaForCausalLM(GaudiAttentionMixin, GemmaForCausalLM):
    """`GemmaForCausalLM` with the Gaudi attention."""


class GaudiGemma2ForCausalLM(GaudiAttentionMixin, Gemma2ForCausalLM):
    """`Gemma2ForCausalLM` with the Gaudi attention.

    Its soft-capped attention logits have no fused kernel: with `use_flash_attention` those layers take the
    default path, with one warning. A config with `attn_logit_softcapping=None` runs fully fused.
    """


class GaudiGemma3ForCausalLM(GaudiAttentionMixin, Gemma3ForCausalLM):
    """`Gemma3ForCausalLM` (text) with the Gaudi attention; `query_pre_attn_scalar` arrives as the scale."""


class GaudiPhi3ForCausalLM(GaudiAttentionMixin, Phi3ForCausalLM):
    """`Phi3ForCausalLM` with the Gaudi attention."""


class GaudiStarcoder2ForCausalLM(GaudiAttentionMixin, Starcoder2ForCausalLM):
    """`Starcoder2ForCausalLM` with the Gaudi attention."""


class GaudiGraniteForCausalLM(GaudiAttentionMixin, GraniteForCausalLM):
    """`GraniteForCausalLM` with the Gaudi attention; its `attention_multiplier` arrives as the scale."""


class GaudiOlmo2ForCausalLM(GaudiAttentionMixin, Olmo2ForCausalLM):
    """`Olmo2ForCausalLM` with the Gaudi attention."""


# model_type -> Gaudi class, in the order the docs list them.
GAUDI_CAUSAL_LM_CLASSES: dict[str, type[GaudiAttentionMixin]] = {
    model_class.config_class.model_type: model_class
    for model_class in (
        GaudiLlamaForCausalLM,
        GaudiMistralForCausalLM,
        GaudiMixtralForCausalLM,
        GaudiQwen2ForCausalLM,
        GaudiQwen2MoeForCausalLM,
        GaudiQwen3ForCausalLM,
        GaudiQwen3MoeForCausalLM,
        GaudiGemmaForCausalLM,
        GaudiGemma2ForCausalLM,
        GaudiGemma3ForCausalLM,
        GaudiPhi3ForCausalLM,
        GaudiStarcoder2ForCausalLM,
        GaudiGraniteForCausalLM,
        GaudiOlmo2ForCausalLM,
    )
}
