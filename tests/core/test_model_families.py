"""Every supported family: the flag reaches every attention call, and greedy tokens equal stock transformers' eager.

Each family's Gaudi class is its stock class with `GaudiAttentionMixin` in front; the stock class, built with
`attn_implementation="eager"` and the same weights, is the reference.
"""

import warnings

import pytest
import torch

from optimum.habana import GaudiGenerationConfig, gaudi_model_class, supported_model_types
from optimum.habana.kernels import dispatch
from optimum.habana.transformers.cache import BucketedStaticCache
from tests.helpers import (
    FAMILIES,
    FUSED_KERNEL_CPU,
    SLIDING_WINDOW_CONFIGS,
    SOFT_CAPPED,
    TINY_SIZES,
    build_pair,
    count_attention_paths,
    left_padded_batch,
)


NEW_TOKENS = 4
LAYERS = TINY_SIZES["num_hidden_layers"]
ATTENTION_CALLS = LAYERS * NEW_TOKENS  # the prefill, then one decode step per new token after the first


def greedy(model, inputs, **kwargs) -> torch.Tensor:
    return model.generate(
        **inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **kwargs
    )


def test_the_written_families_are_supported_first():
    assert FAMILIES == (
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "starcoder2",
        "granite",
        "olmo2",
    )
    assert supported_model_types()[: len(FAMILIES)] == FAMILIES
    with pytest.raises(ValueError, match="no Gaudi model for the model type 'stablelm': StableLmDecoderLayer.forward"):
        gaudi_model_class("stablelm")


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("lengths", [[12], [12, 5, 9]], ids=["batch 1", "left-padded batch"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_flash_tokens_equal_stock_eager(model_type, lengths, cache_implementation, monkeypatch):
    ours, stock = build_pair(model_type)
    inputs = left_padded_batch(lengths)
    reference = greedy(stock, inputs, cache_implementation=cache_implementation)

    with count_attention_paths(monkeypatch) as counts:
        default = greedy(ours, inputs, cache_implementation=cache_implementation)
    assert counts["default"] == ATTENTION_CALLS and counts["fused"] == 0
    dispatch.warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught, count_attention_paths(monkeypatch) as counts:
        warnings.simplefilter("always")
        flash = greedy(ours, inputs, cache_implementation=cache_implementation, use_flash_attention=True)
        config = GaudiGenerationConfig(use_flash_attention=True)
        from_config = greedy(ours, inputs, cache_implementation=cache_implementation, generation_config=config)
    notes = [str(warning.message) for warning in caught if "use_flash_attention" in str(warning.message)]

    assert torch.equal(default, reference)
    assert torch.equal(flash, reference)
    assert torch.equal(from_config, reference)
    if model_type in SOFT_CAPPED:
        assert counts["fused"] == 0 and counts["default"] == 2 * ATTENTION_CALLS
        assert len(notes) == 1 and "soft-caps its attention logits (softcap=50.0)" in notes[0]
    else:
        assert counts["fused"] == counts[FUSED_KERNEL_CPU] == 2 * ATTENTION_CALLS
        assert counts["default"] == 0 and notes == []


# A window of 5 tokens, shorter than the 12-token prompts; some families mix sliding and full layers.


@pytest.mark.parametrize("model_type", SLIDING_WINDOW_CONFIGS)
def test_sliding_window_longer_prompt_is_honoured(model_type, monkeypatch):
    ours, stock = build_pair(model_type, **SLIDING_WINDOW_CONFIGS[model_type])
    inputs = left_padded_batch([12, 8, 12], seed=2)
    reference = greedy(stock, inputs)
    # A window longer than the prompt changes the logits: the test can tell a dropped window from a kept one.
    no_window = build_pair(model_type, **{**SLIDING_WINDOW_CONFIGS[model_type], "sliding_window": 64})[1]
    with torch.no_grad():
        windowed_logits, full_logits = stock(**inputs).logits, no_window(**inputs).logits
    assert not torch.allclose(windowed_logits, full_logits, atol=1e-4)

    dispatch.warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught, count_attention_paths(monkeypatch) as counts:
        warnings.simplefilter("always")
        flash = greedy(ours, inputs, use_flash_attention=True)
        causal = greedy(ours, inputs, use_flash_attention=True, flash_attention_causal_mask=True)
    assert torch.equal(flash, reference)
    assert torch.equal(causal, reference)
    # A windowed layer's prompt runs in two fused calls (its first window, then the rest): at least one per call.
    assert counts["default"] == 0 and counts["fused"] >= 2 * ATTENTION_CALLS
    # Off Gaudi the window needs no mask, in the causal-mask mode too: nothing to warn about.
    assert not [warning for warning in caught if "sliding window of 5 tokens" in str(warning.message)]


def test_gemma2_soft_capping_and_scaling_match_stock_eager():
    """A strong cap (1.0) and a non-default query_pre_attn_scalar, so both visibly change the logits."""
    overrides = {"attn_logit_softcapping": 1.0, "head_dim": 16, "query_pre_attn_scalar": 64}
    ours, stock = build_pair("gemma2", **overrides)
    inputs = left_padded_batch([12, 5, 9], seed=3)
    reference = greedy(stock, inputs)
    with pytest.warns(UserWarning, match="soft-caps its attention logits"):
        dispatch.warn_once.cache_clear()
        flash = greedy(ours, inputs, use_flash_attention=True)
    assert torch.equal(flash, reference)
    assert torch.equal(greedy(ours, inputs), reference)
    uncapped = build_pair("gemma2", **{**overrides, "attn_logit_softcapping": None})[1]
    with torch.no_grad():
        assert not torch.allclose(stock(**inputs).logits, uncapped(**inputs).logits, atol=1e-3)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_bucketed_static_cache_gives_stock_tokens(model_type):
    """Optimum-Habana's --bucket_size (grown) and --bucket_internal (preallocated) caches, sliding layers included."""
    overrides = SLIDING_WINDOW_CONFIGS.get(model_type, {})
    ours, stock = build_pair(model_type, **overrides)
    inputs = left_padded_batch([9, 6, 9], seed=3)
    reference = stock.generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    for preallocate in (True, False):
        cache = BucketedStaticCache(ours.config, max_cache_len=19, bucket_size=4, preallocate=preallocate)
        flash = ours.generate(
            **inputs,
            past_key_values=cache,
            use_flash_attention=True,
            max_new_tokens=10,
            min_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
        )
        assert torch.equal(flash, reference), preallocate
