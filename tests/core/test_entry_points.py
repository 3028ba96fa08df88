"""The model's flag defaults reach every attention call, whatever the entry point: the causal LM, the decoder
(`model.base_model`, which TRL calls), a decoder layer, an attention module, under PEFT, with gradient checkpointing,
padding-free; and what stock keeps (keywords, attention names, padded positions, experts, return types) stays so."""

import typing

import pytest
import torch
from peft import LoraConfig, PromptTuningConfig, get_peft_model
from transformers import LlamaForCausalLM

from optimum.habana import GaudiLlamaForCausalLM, gaudi_model_class
from optimum.habana.kernels import variable_length
from optimum.habana.transformers import attention
from tests.helpers import (
    FAMILIES,
    FUSED_KERNEL_CPU,
    SOFT_CAPPED,
    build_pair,
    count_attention_paths,
    left_padded_batch,
    spy_on_fused_kernel,
    tiny_config,
    tiny_llama_config,
)


LAYERS = 2


def flag_on_by_default(model):
    model.generation_config.use_flash_attention = True
    return model


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_decoder_called_directly_runs_the_models_default(model_type, monkeypatch):
    """TRL's route: `model.base_model(...)`, hidden states equal to the causal LM's own call with the flag."""
    ours, stock = build_pair(model_type)
    inputs = left_padded_batch([9, 5, 7], seed=3)
    with torch.no_grad():
        expected = stock.base_model(**inputs).last_hidden_state
        with count_attention_paths(monkeypatch, profile=False) as off:
            ours.base_model(**inputs)
        assert off["fused"] == 0 and off["default"] == LAYERS  # counters keep counting after their block
        flag_on_by_default(ours)
        with count_attention_paths(monkeypatch, profile=False) as on:
            hidden = ours.base_model(**inputs).last_hidden_state
    real = inputs["attention_mask"].bool()  # the stock reference is eager: its padded positions differ from SDPA's
    torch.testing.assert_close(hidden[real], expected[real], rtol=1e-5, atol=1e-5)
    if model_type in SOFT_CAPPED:
        assert on["fused"] == 0  # its soft-capped logits take the default path, with one warning
    else:
        assert on["fused"] == LAYERS and on["default"] == 0


def test_a_positional_decoder_call_and_an_explicit_flag_win_over_the_default(monkeypatch):
    model = flag_on_by_default(GaudiLlamaForCausalLM(tiny_llama_config()).eval())
    input_ids = left_padded_batch([6])["input_ids"]
    with torch.no_grad(), count_attention_paths(monkeypatch) as counts:
        model.model(input_ids)
    assert counts["fused"] == counts[FUSED_KERNEL_CPU] == LAYERS
    with torch.no_grad(), count_attention_paths(monkeypatch, profile=False) as counts:
        model.model(input_ids, use_flash_attention=False)
    assert counts["default"] == LAYERS and counts["fused"] == 0


def test_a_layer_and_an_attention_module_called_directly_run_the_models_default(monkeypatch):
    model = flag_on_by_default(GaudiLlamaForCausalLM(tiny_llama_config()).eval())
    hidden = torch.randn(1, 6, model.config.hidden_size)
    position_ids = torch.arange(6)[None]
    position_embeddings = model.model.rotary_emb(hidden, position_ids=position_ids)
    layer = model.model.layers[0]
    with torch.no_grad(), count_attention_paths(monkeypatch, profile=False) as counts:
        layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
        layer.self_attn(hidden, position_embeddings=position_embeddings, attention_mask=None)
    assert counts["fused"] == 2 and counts["default"] == 0


def test_a_replaced_generation_config_reaches_the_attention(monkeypatch):
    model = GaudiLlamaForCausalLM(tiny_llama_config()).eval()
    replacement = type(model.generation_config).from_dict({**model.generation_config.to_dict()})
    replacement.use_flash_attention = True
    model.generation_config = replacement
    with torch.no_grad(), count_attention_paths(monkeypatch, profile=False) as counts:
        model.base_model(**left_padded_batch([5]))
    assert counts["fused"] == LAYERS


def test_attn_implementation_sdpa_reaches_a_direct_decoder_call(tmp_path, monkeypatch):
    GaudiLlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path)
    model = GaudiLlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    with torch.no_grad(), count_attention_paths(monkeypatch, profile=False) as counts:
        model.base_model(**left_padded_batch([5, 3]))
    assert counts["fused"] == LAYERS and counts["default"] == 0


def test_peft_wrapper_and_gradient_checkpointing_through_the_decoder(monkeypatch):
    """LoRA around the model, checkpointed training: every call fused, and the kernel asked to recompute."""
    model = flag_on_by_default(GaudiLlamaForCausalLM(tiny_llama_config()))
    model.gradient_checkpointing_enable()
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft_model.train()
    recompute = []
    kernel = attention.fused_sdpa

    def spy(*args, **kwargs):
        recompute.append(kwargs["recompute"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention, "fused_sdpa", spy)
    monkeypatch.setattr(variable_length, "fused_sdpa", spy)  # the padded prompt's calls
    decoder = peft_model.base_model.model.model
    hidden = decoder(**left_padded_batch([7, 4])).last_hidden_state
    hidden.sum().backward()
    assert recompute and all(recompute)
    assert len(recompute) == 2 * LAYERS  # forward, and its rerun in backward


def prompt_tuned_pair(model_type: str, **overrides):
    """PEFT's prompt tuning around the Gaudi class and around the stock one (its default SDPA), the same weights."""
    ours, stock = build_pair(model_type, **overrides)
    stock = type(stock)(tiny_config(model_type, **overrides)).eval()  # stock's default attention, not eager
    stock.load_state_dict(ours.state_dict())
    tuned = [
        get_peft_model(model, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5))
        for model in (ours, stock)
    ]
    tuned[0].load_state_dict(tuned[1].state_dict())
    return tuned


@pytest.mark.parametrize(
    "model_type, overrides", [("llama", {}), ("mistral", {"sliding_window": 8})], ids=["llama", "sliding window"]
)
def test_prompt_tuning_generates_stocks_steps_from_a_left_padded_batch(model_type, overrides):
    """PEFT prepends ones for its virtual tokens to the mask after the model read the prompt's padding side: a
    left-padded row's padding is then in the middle. The decoder plans from the mask it gets, not the stale side."""
    ours, stock = prompt_tuned_pair(model_type, **overrides)
    inputs = left_padded_batch([10, 6])
    settings = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    settings |= {"output_logits": True, "return_dict_in_generate": True}
    expected = stock.generate(**inputs, **settings)
    found = ours.generate(**inputs, **settings, use_flash_attention=True)
    assert torch.equal(found.sequences, expected.sequences)
    for step, (logits, reference) in enumerate(zip(found.logits, expected.logits, strict=True)):
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5, msg=f"step {step}")


def test_prompt_tuning_trains_on_a_left_padded_batch_as_stock(monkeypatch):
    """With its virtual tokens first, a left-padded row's last padding position attends to them under stock's mask,
    and the loss reads it (it predicts the first real token): the flag's loss and gradients are stock's, fused."""
    ours, stock = prompt_tuned_pair("llama")
    inputs = left_padded_batch([10, 6])
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)

    def loss_and_gradients(model, **flags):
        loss = model(**inputs, labels=labels, **flags).loss
        loss.backward()
        return loss.detach(), [parameter.grad for parameter in model.parameters() if parameter.requires_grad]

    expected_loss, expected_gradients = loss_and_gradients(stock)
    with count_attention_paths(monkeypatch, profile=False) as counts:
        loss, gradients = loss_and_gradients(ours, use_flash_attention=True)
    assert counts["fused"] == LAYERS and counts["default"] == 0
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    for gradient, expected in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(gradient, expected, rtol=1e-5, atol=1e-7)
    with torch.no_grad():  # evaluation (Trainer.evaluate) reads the same position: it ran with the padding zeroed
        expected = stock(**inputs, labels=labels)
        found = ours(**inputs, labels=labels, use_flash_attention=True)
    torch.testing.assert_close(found.loss, expected.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(found.logits, expected.logits, rtol=1e-5, atol=1e-5)


def test_padding_free_batches_through_the_decoder_run_one_call_per_example(monkeypatch):
    """TRL's padding_free: position ids restarting per example, no mask, at the decoder."""
    model = flag_on_by_default(GaudiLlamaForCausalLM(tiny_llama_config()).eval())
    lengths = [5, 3, 4]
    input_ids = torch.randint(3, 256, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    with torch.no_grad(), count_attention_paths(monkeypatch, profile=False) as counts:
        packed = model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    assert counts["fused"] == LAYERS * len(lengths)
    with torch.no_grad():
        start = 0
        for length in lengths:
            alone = model.base_model(input_ids=input_ids[:, start : start + length], use_cache=False)
            torch.testing.assert_close(packed[:, start : start + length], alone.last_hidden_state)
            start += length


@pytest.mark.parametrize("flag", [False, True], ids=["flag off", "flag on"])
@pytest.mark.parametrize("padding", ["right", "left", "holes"])
def test_padded_positions_equal_stocks(padding, flag):
    """Every real position as the stock class computes it (its default SDPA attention); the padding positions too on
    the default path. The fused path runs a padded prompt without its mask, and a padding position's attention output
    is zero there (as in transformers' flash_attention_2): only left padding, which attends to nothing under the mask
    either, keeps stock's values."""
    torch.manual_seed(0)
    ours = GaudiLlamaForCausalLM(tiny_llama_config()).eval()
    stock = LlamaForCausalLM(tiny_llama_config()).eval()
    stock.load_state_dict(ours.state_dict())
    input_ids = torch.randint(3, 256, (4, 7), generator=torch.Generator().manual_seed(2))
    if padding == "right":  # the lower-triangular mask of transformers' model testers
        attention_mask = torch.tril(torch.ones_like(input_ids))
    elif padding == "left":
        attention_mask = left_padded_batch([7, 4, 1, 6])["attention_mask"]
    else:
        attention_mask = torch.tensor([[1, 1, 0, 1, 1, 0, 1]] * 2 + [[0, 1, 1, 0, 0, 1, 1]] * 2)
    with torch.no_grad():
        expected = stock(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        logits = ours(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, use_flash_attention=flag)
    if flag and padding != "left":
        real = attention_mask.bool()
        torch.testing.assert_close(logits.logits[real], expected[real], rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(logits.logits, expected, rtol=1e-5, atol=1e-5)


def test_loss_keywords_of_the_stock_forward_are_accepted_and_honoured():
    """`shift_labels` (pre-shifted targets, sequence-parallel training) reaches the loss, not the attention."""
    model = flag_on_by_default(GaudiLlamaForCausalLM(tiny_llama_config()).eval())
    inputs = left_padded_batch([6, 6])
    labels = inputs["input_ids"]
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    with torch.no_grad():
        by_labels = model(**inputs, labels=labels).loss
        by_shift = model(**inputs, labels=labels, shift_labels=shifted).loss
        other = model(**inputs, labels=labels, shift_labels=torch.roll(shifted, 1, dims=1)).loss
    torch.testing.assert_close(by_shift, by_labels)
    assert not torch.allclose(other, by_labels)  # the loss reads shift_labels, not labels, when both are given


def test_attention_names_are_kept_as_stock_keeps_them():
    model = GaudiLlamaForCausalLM(tiny_llama_config())
    stock = LlamaForCausalLM(tiny_llama_config())
    assert model.config._attn_implementation == stock.config._attn_implementation == "sdpa"
    assert model.generation_config.use_flash_attention is None  # the default name leaves the flag alone
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager" and model.generation_config.use_flash_attention is False
    with pytest.raises(ValueError, match='Specified `attn_implementation="foo"` is not supported'):
        model.set_attn_implementation("foo")
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa" and model.generation_config.use_flash_attention is True
    assert all(
        module.config._attn_implementation == "gaudi"  # every layer still looks up the Gaudi attention
        for module in model.modules()
        if type(module).__name__.endswith("Attention")
    )


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_moe_families_keep_transformers_experts_and_return_types(model_type):
    model_class = gaudi_model_class(model_type)
    stock_class = model_class.__bases__[-1]
    model = model_class(tiny_config(model_type))
    stock = stock_class(tiny_config(model_type))
    assert model.config._experts_implementation == stock.config._experts_implementation == "grouped_mm"
    model.set_experts_implementation("eager")
    assert model.config._experts_implementation == "eager"
    returns = model_class.forward.__annotations__["return"]
    assert returns is stock_class.forward.__annotations__["return"]
    assert "router_logits" in {
        field for kind in (typing.get_args(returns) or (returns,)) for field in kind.__dataclass_fields__
    }


def test_compiled_fullgraph_forward_of_a_soft_capping_family_with_the_flag():
    """No Python warning inside the traced region: Gemma 2's fallback warning is issued outside compiled code only."""
    ours, _ = build_pair("gemma2")
    flag_on_by_default(ours)
    compiled = torch.compile(ours.forward, fullgraph=True, backend="eager")
    inputs = left_padded_batch([6])
    with torch.no_grad():
        torch.testing.assert_close(compiled(**inputs).logits, ours(**inputs).logits)


def test_the_decoder_called_with_one_flag_takes_the_others_from_the_model(monkeypatch):
    """`model.model(ids, use_flash_attention=True)`: the flag given, recompute from the model's defaults."""
    model = GaudiLlamaForCausalLM(tiny_llama_config()).eval()
    model.generation_config.flash_attention_recompute = True  # a companion without the flag: off until turned on
    seen = []

    def spy(fused_sdpa):
        def recording(*args, **kwargs):
            seen.append(kwargs["recompute"])
            return fused_sdpa(*args, **kwargs)

        return recording

    spy_on_fused_kernel(monkeypatch, spy)
    with torch.no_grad():
        model.model(torch.randint(3, 256, (1, 6)), use_flash_attention=True)
    assert seen == [True] * LAYERS
