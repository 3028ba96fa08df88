"""Opt-in wiring of the Gaudi models into transformers' Auto classes."""

from transformers import AutoModelForCausalLM, LlamaConfig

from .models.llama import GaudiLlamaForCausalLM


def adapt_transformers_to_gaudi() -> None:
    """Make `AutoModelForCausalLM` build `GaudiLlamaForCausalLM` for Llama checkpoints.

    This goes through the Auto classes' public registry; no transformers class is modified, and models built
    directly from `LlamaForCausalLM` keep their stock attention.
    """
    AutoModelForCausalLM.register(LlamaConfig, GaudiLlamaForCausalLM, exist_ok=True)
