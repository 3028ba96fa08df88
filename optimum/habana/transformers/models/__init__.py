from .llama import GaudiLlamaForCausalLM


__all__ = ["GaudiLlamaForCausalLM"]
