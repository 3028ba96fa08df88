"""A padded prompt on the flash path builds no N x N mask, and gives the same results as the default path."""

import pytest
import torch
import transformers.masking_utils

from optimum.habana import GaudiLlamaForCausalLM, GaudiMistralForCausalLM, gaudi_model_class
from optimum.habana.kernels import dispatch, local_attention, variable_length
from optimum.habana.transformers import attention
from tests.families.tiny_configs import tiny_family_config
from tests.helpers import left_padded_batch, tiny_config, tiny_llama_config


@pytest.fixture(scope="module")
def model() -> GaudiLlamaForCausalLM:
    torch.manual_seed(0)
    return GaudiLlamaForCausalLM(tiny_llama_config()).eval()


def spy_masks_and_kernel(monkeypatch) -> tuple[list, list]:
    """Record the 4-D masks transformers builds and the kernel calls' (query length, mask, is_causal)."""
    built, kernel_masks = [], []
    real_mask, real_kernel = transformers.masking_utils.sdpa_mask, attention.fused_sdpa

    def mask(*args, **kwargs):
        result = real_mask(*args, **kwargs)
        built.append(result)
        return result

    def kernel(query, key, value, attn_mask, **kwargs):
        kernel_masks.append((query.shape[2], attn_mask, kwargs["is_causal"]))
        return real_kernel(query, key, value, attn_mask, **kwargs)

    for name in ("gaudi", "gaudi_fused_sdpa", "sdpa"):
        monkeypatch.setitem(transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name, mask)
    for module in (attention, variable_length, local_attention):
        monkeypatch.setattr(module, "fused_sdpa", kernel)
    return built, kernel_masks


@pytest.mark.parametrize("causal_mask", [False, True])
def test_padded_prefill_builds_no_mask_and_keeps_the_tokens(model, monkeypatch, causal_mask):
    inputs = left_padded_batch([12, 7, 3])
    default = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    built, kernel_masks = spy_masks_and_kernel(monkeypatch)
    flash = model.generate(
        **inputs,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        use_flash_attention=True,
        flash_attention_causal_mask=causal_mask,
    )
    assert torch.equal(default, flash)
    prefill = [call for call in kernel_masks if call[0] > 1]
    assert len(prefill) == model.config.num_hidden_layers
    for _, mask, is_causal in prefill:  # causal over the real tokens, which the rows' permutation put first
        assert mask is None and is_causal
    # The decode steps' masks are [B, 1, 1, kv]: only those were built.
    assert built and all(mask.shape[-2] == 1 for mask in built if mask is not None)
    assert model.config._attn_implementation == "sdpa"  # no name was swapped for the call


def test_default_path_fallback_rebuilds_the_padding_mask(model):
    """output_attentions sends the call to the default path, which then needs the padding after all."""
    inputs = left_padded_batch([10, 4])
    real = inputs["attention_mask"].bool()
    dispatch.warn_once.cache_clear()  # another test in this process may have had the one warning already
    with pytest.warns(UserWarning, match="output_attentions"):
        flash = model(**inputs, use_flash_attention=True, output_attentions=True)
    default = model(**inputs, output_attentions=True)
    torch.testing.assert_close(flash.logits[real], default.logits[real])
    for ours, reference in zip(flash.attentions, default.attentions, strict=True):
        torch.testing.assert_close(ours[1, :, -1], reference[1, :, -1])


def test_sliding_window_models_build_no_prompt_mask_either(monkeypatch):
    """A windowed layer's padded prompt runs in windows (`kernels/local_attention.py`): the kernel reads at most the
    `[W, 2W]` band of one window, never a `[q, kv]` mask, and the logits are the mask's."""
    torch.manual_seed(0)
    model = GaudiMistralForCausalLM(tiny_config("mistral", sliding_window=4)).eval()
    inputs = left_padded_batch([9, 5])
    with torch.no_grad():
        expected = model(**inputs).logits  # the default path reads transformers' windowed mask
        built, kernel_masks = spy_masks_and_kernel(monkeypatch)
        flash = model(**inputs, use_flash_attention=True).logits
    assert not any(mask is not None and mask.shape[-2] == 9 for mask in built)
    assert all(mask is None or mask.shape[-2:] == (4, 8) for _, mask, _ in kernel_masks)
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(flash[real], expected[real])


def test_a_family_whose_config_has_another_model_type_builds_no_prompt_mask(monkeypatch):
    """Emu3's config carries the model type 'emu3_text_model', not its family's 'emu3': its padded prompt runs as
    Llama's does, causally over the real tokens with no mask built (it built a [B, 1, q, kv] mask when that model type
    read as no family)."""
    model_class = gaudi_model_class("emu3")
    torch.manual_seed(0)
    model = model_class(tiny_family_config("emu3", model_class.config_class)).eval()
    assert model.config.model_type == "emu3_text_model"
    inputs = left_padded_batch([12, 7, 3])
    with torch.no_grad():
        expected = model(**inputs).logits
        built, kernel_masks = spy_masks_and_kernel(monkeypatch)
        flash = model(**inputs, use_flash_attention=True).logits
    assert all(mask is None for mask in built)
    assert len(kernel_masks) == model.config.num_hidden_layers
    assert all(mask is None and is_causal for _, mask, is_causal in kernel_masks)
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(flash[real], expected[real])


def test_a_family_that_makes_its_own_mask_keeps_it_in_the_causal_mask_mode(tmp_path):
    """Qwen4's attention merges its indexer's selection into the decoder's mask. The causal-mask mode planned its
    padded prompts like any family's, causal over the rows' real tokens, which dropped the selection: logits 0.57 off
    and other tokens. The mode now leaves such a family its mask, says so once, and every step is stock's; --explain
    says the same."""
    import warnings

    from optimum.habana.cli.generation.explain import explain
    from optimum.habana.transformers.families.lookups import attention_with_its_own_mask
    from tests.families.support import assert_same_steps, family_pair, greedy, save_family_checkpoint
    from tests.generation.support import parse
    from tests.helpers import train_tiny_tokenizer

    assert attention_with_its_own_mask("qwen4_exp_text") == "Qwen4ExpTextAttention"
    assert attention_with_its_own_mask("qwen3") is None
    ours, stock = family_pair("qwen4_exp_text")
    inputs = left_padded_batch([12, 5, 9], seed=7)
    dispatch.warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        steps = greedy(ours, inputs, use_flash_attention=True, flash_attention_causal_mask=True)
    assert_same_steps(steps, greedy(stock, inputs))
    said = [str(warning.message) for warning in record if "makes its own mask" in str(warning.message)]
    assert said == [
        "flash_attention_causal_mask: Qwen4ExpTextAttention makes its own mask from transformers' (what its layer "
        "adds: an indexer's selection, compressed blocks); its calls take that mask, not the rows' valid lengths."
    ]
    checkpoint = save_family_checkpoint(tmp_path, "qwen4_exp_text", train_tiny_tokenizer(True))
    argv = ["--model_name_or_path", str(checkpoint), "--use_flash_attention", "--flash_attention_causal_mask"]
    prefill = explain(parse([*argv, "--batch_size", "2", "--max_new_tokens", "2"])).split("  prefill")[1]
    assert "attn_mask=boolean" in prefill and "real tokens" not in prefill.split("  decode")[0]
