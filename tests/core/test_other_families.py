"""Other model families reuse the Gaudi attention by registration alone (`attn_implementation="gaudi"`)."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

import optimum.habana  # noqa: F401  (registers the "gaudi" attention and its mask function)
from tests.helpers import FUSED_KERNEL_CPU, TINY_SIZES, count_attention_paths


@pytest.mark.parametrize(
    "config_class, model_class", [(MistralConfig, MistralForCausalLM), (Qwen2Config, Qwen2ForCausalLM)]
)
def test_forward_with_the_flag_matches_eager(config_class, model_class, monkeypatch):
    torch.manual_seed(0)
    eager = model_class(config_class(**TINY_SIZES, attn_implementation="eager")).eval()
    gaudi = model_class(config_class(**TINY_SIZES, attn_implementation="gaudi")).eval()
    gaudi.load_state_dict(eager.state_dict())
    input_ids = torch.randint(3, 256, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :5] = 0

    with torch.no_grad(), count_attention_paths(monkeypatch) as counts:
        flash = gaudi(input_ids, attention_mask=attention_mask, use_flash_attention=True).logits
    reference = eager(input_ids, attention_mask=attention_mask).logits
    assert counts["fused"] == counts[FUSED_KERNEL_CPU] == 2 and counts["default"] == 0
    real = attention_mask.bool()
    assert (flash[real] - reference[real]).abs().max() <= 1e-4
