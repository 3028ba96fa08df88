"""A tiny random model of any supported family and its inputs, as transformers' model tests ask their tester for.

Written for this project: transformers' own `CausalLMModelTester` is not in its source distribution. The sizes
are those of transformers' testers (a batch of 3 prompts of 7 tokens, 2 layers, 4 query heads over 2 key/value
heads) and the attention mask is lower-triangular, so the batch holds every amount of right padding.
"""

import torch
from transformers import AutoConfig, PreTrainedConfig


# What a family needs besides the common sizes to be small and to exercise its attention features.
FAMILY_OVERRIDES = {
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
    },
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "mixtral": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
    },  # grouped_mm: 16-byte strides
    "gemma2": {"head_dim": 8},
    "gemma3_text": {"head_dim": 8, "sliding_window": 4},
    "gemma": {"head_dim": 8},
}


class CausalLMTester:
    """What `ModelTesterMixin` reads off `self.model_tester`."""

    batch_size = 3
    seq_length = 7
    is_training = True
    vocab_size = 99
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    intermediate_size = 37

    def __init__(self, parent, model_type: str) -> None:
        self.parent, self.model_type = parent, model_type

    def get_config(self) -> PreTrainedConfig:
        values = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": 512,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        return AutoConfig.for_model(self.model_type, **{**values, **FAMILY_OVERRIDES.get(self.model_type, {})})

    def prepare_config_and_inputs_for_common(self) -> tuple[PreTrainedConfig, dict[str, torch.Tensor]]:
        input_ids = torch.randint(3, self.vocab_size, (self.batch_size, self.seq_length))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": torch.tril(torch.ones_like(input_ids))}
