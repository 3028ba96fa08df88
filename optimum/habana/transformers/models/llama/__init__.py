from .modeling_llama import GaudiLlamaForCausalLM, causal_prefill_padding, gaudi_attention_forward


__all__ = ["GaudiLlamaForCausalLM", "causal_prefill_padding", "gaudi_attention_forward"]
