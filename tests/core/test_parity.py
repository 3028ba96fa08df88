"""Flash attention and the default path give the same answers, and both match stock transformers' eager Llama."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from optimum.habana import GaudiLlamaForCausalLM
from optimum.habana.transformers import attention
from tests.helpers import left_padded_batch, tiny_llama_config


FP32_LOGITS_TOLERANCE = 1e-4
# Measured on this tiny model: flash vs default bf16 logits differ by up to 0.051 on logits of magnitude <= 3.8
# (bf16 keeps 8 mantissa bits and the two paths round at different points). See docs/attention.md.
BF16_LOGITS_TOLERANCE = 0.08
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def models() -> tuple[GaudiLlamaForCausalLM, LlamaForCausalLM]:
    """Our model and stock transformers' eager Llama with the same weights."""
    torch.manual_seed(0)
    config = tiny_llama_config(initializer_range=0.1)
    ours = GaudiLlamaForCausalLM(config).eval()
    stock = LlamaForCausalLM(tiny_llama_config(initializer_range=0.1, attn_implementation="eager")).eval()
    stock.load_state_dict(ours.state_dict())
    assert stock.config._attn_implementation == "eager"
    return ours, stock


def greedy(model, inputs, **kwargs) -> torch.Tensor:
    return model.generate(
        **inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **kwargs
    )


def max_diff_at_real_positions(a: torch.Tensor, b: torch.Tensor, attention_mask: torch.Tensor) -> float:
    real = attention_mask.bool()
    return (a[real] - b[real]).abs().max().item()


CASES = {
    "batch 1": [12],
    "left-padded batch": [12, 5, 9],
    "long prompt": [1100],
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_greedy_tokens_match_default_and_stock_eager(models, case, cache_implementation):
    ours, stock = models
    inputs = left_padded_batch(CASES[case])
    reference = greedy(stock, inputs, cache_implementation=cache_implementation)
    default = greedy(ours, inputs, cache_implementation=cache_implementation)
    flash = greedy(ours, inputs, cache_implementation=cache_implementation, use_flash_attention=True)
    assert torch.equal(default, reference)
    assert torch.equal(flash, reference)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_at_real_positions(models, case):
    ours, stock = models
    inputs = left_padded_batch(CASES[case])
    with torch.no_grad():
        reference = stock(**inputs).logits
        default = ours(**inputs).logits
        flash = ours(**inputs, use_flash_attention=True).logits
        causal = ours(**inputs, use_flash_attention=True, flash_attention_causal_mask=True).logits
    mask = inputs["attention_mask"]
    assert max_diff_at_real_positions(default, reference, mask) <= FP32_LOGITS_TOLERANCE
    assert max_diff_at_real_positions(flash, reference, mask) <= FP32_LOGITS_TOLERANCE
    assert max_diff_at_real_positions(causal, reference, mask) <= FP32_LOGITS_TOLERANCE


@pytest.mark.parametrize("lengths", [[12, 12], [12, 5, 9]], ids=["no padding", "left padding"])
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_causal_mask_mode_gives_the_same_tokens(models, lengths, cache_implementation):
    ours, stock = models
    inputs = left_padded_batch(lengths, seed=3)
    reference = greedy(stock, inputs, cache_implementation=cache_implementation)
    causal = greedy(
        ours,
        inputs,
        cache_implementation=cache_implementation,
        use_flash_attention=True,
        flash_attention_causal_mask=True,
    )
    assert torch.equal(causal, reference)


def test_right_padding_in_training_matches(models):
    """Right padding is what training batches use; the causal-mask mode then needs a single causal call."""
    ours, stock = models
    inputs = left_padded_batch([10, 6], seed=4)
    inputs = {name: tensor.flip(-1) for name, tensor in inputs.items()}
    with torch.no_grad():
        reference = stock(**inputs).logits
        causal = ours(**inputs, use_flash_attention=True, flash_attention_causal_mask=True).logits
    assert max_diff_at_real_positions(causal, reference, inputs["attention_mask"]) <= FP32_LOGITS_TOLERANCE


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_a_right_padded_prompt_generates_stock_tokens_and_logits(models, cache_implementation):
    """generate() continues each row from its last position, a padding one in the shorter rows (transformers warns
    against it): the flag changes nothing there either."""
    ours, stock = models
    inputs = {name: tensor.flip(-1) for name, tensor in left_padded_batch([12, 5, 9], seed=2).items()}
    options = {"return_dict_in_generate": True, "output_logits": True, "cache_implementation": cache_implementation}
    reference = greedy(stock, inputs, **options)
    for flags in (
        {},
        {"use_flash_attention": True},
        {"use_flash_attention": True, "flash_attention_causal_mask": True},
    ):
        found = greedy(ours, inputs, **options, **flags)
        assert torch.equal(found.sequences, reference.sequences), flags
        for step, logits in enumerate(found.logits):
            assert (logits - reference.logits[step]).abs().max() <= FP32_LOGITS_TOLERANCE, (flags, step)


def test_bf16_tolerance(models):
    ours, _ = models
    model = GaudiLlamaForCausalLM(ours.config).to(torch.bfloat16).eval()
    model.load_state_dict(ours.state_dict())
    inputs = left_padded_batch([64, 40, 17], seed=5)
    with torch.no_grad():
        default = model(**inputs).logits.float()
        flash = model(**inputs, use_flash_attention=True).logits.float()
    assert max_diff_at_real_positions(flash, default, inputs["attention_mask"]) <= BF16_LOGITS_TOLERANCE


def test_compiled_decode_matches(models, monkeypatch):
    """transformers' compiled decode step (static cache) runs the fused kernel with no graph break per layer."""
    from transformers import CompileConfig

    ours, stock = models
    inputs = left_padded_batch([12, 5, 9], seed=6)
    reference = greedy(stock, inputs)
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # CPU is skipped otherwise
    torch._dynamo.reset()
    flash = greedy(
        ours, inputs, cache_implementation="static", compile_config=compile_config, use_flash_attention=True
    )
    assert torch.equal(flash, reference)


# --- degenerate input: a row whose attention mask is all zeros ---------------------------------------------------


class _Layer(torch.nn.Module):
    """Stands in for an attention layer: the attention function reads only `training` from it."""


class _PlannedFamilyLayer(_Layer):
    """A layer of a family whose padded prompts the flag plans (Llama): its calls may read a plan, or a mask."""

    config = LlamaConfig()


@pytest.mark.parametrize("layer_class", [_Layer, _PlannedFamilyLayer], ids=["same mask both ways", "planned family"])
@pytest.mark.parametrize("mask_kind", ["bool", "float -inf", "float lowest"])
def test_attention_function_gives_queries_that_attend_to_nothing_stocks_output_or_zero(mask_kind, layer_class):
    """Documented output (docs/attention.md): a query that the mask lets attend to no key gets zero from a boolean
    mask or one of -inf, with and without the flag, as from PyTorch's SDPA. From a float mask's finite lowest score
    (transformers' eager masks, a family's own float mask) it gets the values' average, as stock's eager and SDPA
    give, where every call reads that mask whatever the flag; zero in a family whose padded prompts the flag plans
    (the plan's rows are zero), so that the flag changes no output."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(3, heads, 5, 8, generator=generator) for heads in (4, 2, 2))
    mask = torch.ones(3, 1, 5, 5, dtype=torch.bool).tril()
    mask[1] = False  # a row whose attention mask is all zeros
    mask[2, :, :2] = False  # two left-padding query positions
    if mask_kind != "bool":
        blocked = float("-inf") if mask_kind == "float -inf" else torch.finfo(torch.float32).min
        mask = torch.zeros(mask.shape).masked_fill(~mask, blocked)
    layer = layer_class().eval()
    default, weights = attention.gaudi_attention_forward(layer, query, key, value, mask)
    flash, _ = attention.gaudi_attention_forward(layer, query, key, value, mask, use_flash_attention=True)
    torch.testing.assert_close(flash, default, atol=1e-6, rtol=0)
    real = default[0], default[2, 2:]
    sdpa = torch.nn.functional.scaled_dot_product_attention(query, key, value, mask, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(torch.cat(real), torch.cat([sdpa[0], sdpa[2, 2:]]), atol=1e-6, rtol=0)
    if mask_kind == "float lowest" and layer_class is _Layer:  # the average, on every head of the key/value group
        torch.testing.assert_close(default, sdpa, atol=1e-6, rtol=0)
        assert torch.allclose(default[1], value[1].mean(dim=1).repeat_interleave(2, dim=0)[None], atol=1e-6)
        assert torch.equal(weights[1], torch.full_like(weights[1], 1 / 5))
    else:
        nothing_to_attend = default[1], default[2, :2]
        assert all(torch.equal(output, torch.zeros_like(output)) for output in nothing_to_attend)
        assert torch.equal(weights[1], torch.zeros_like(weights[1]))


def test_model_agrees_on_a_row_with_an_all_zero_attention_mask(models):
    ours, _ = models
    inputs = left_padded_batch([9, 6, 4], seed=7)
    inputs["attention_mask"][1] = 0
    with torch.no_grad():
        default = ours(**inputs).logits
        flash = ours(**inputs, use_flash_attention=True).logits
    assert torch.isfinite(default).all() and torch.isfinite(flash).all()
    torch.testing.assert_close(flash, default, atol=FP32_LOGITS_TOLERANCE, rtol=0)  # every position, row 1 included
    assert torch.equal(greedy(ours, inputs, use_flash_attention=True), greedy(ours, inputs))


def test_training_gradients_agree_with_an_all_zero_attention_mask_row():
    """The zeroed rows carry no NaN into backward: same finite loss and gradients on both paths."""
    torch.manual_seed(0)
    model = GaudiLlamaForCausalLM(tiny_llama_config(initializer_range=0.1)).train()
    inputs = left_padded_batch([6, 4, 3], seed=8)
    inputs["attention_mask"][1] = 0
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    gradients = {}
    for flag in (False, True):
        model.zero_grad()
        loss = model(**inputs, labels=labels, use_flash_attention=flag).loss
        loss.backward()
        assert torch.isfinite(loss)
        gradients[flag] = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert gradients[True].keys() == gradients[False].keys()
    for name, gradient in gradients[True].items():
        assert torch.isfinite(gradient).all(), name
        torch.testing.assert_close(gradient, gradients[False][name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("use_flash_attention", [False, True])
@pytest.mark.parametrize("scored_by", ["position_bias", "indices"])
def test_a_planned_prompt_in_a_static_cache_attends_from_its_first_slot(scored_by, use_flash_attention):
    """A prompt planned from an empty static cache reaches the layers with no mask and keys for every slot: the
    prompt's first, then the unused ones. A family's position bias or indexer selection turns the call into a dense
    mask; its causality starts at the first slot, as without the unused slots (Inkling's static generate() once
    read each query's keys from two slots later)."""
    generator = torch.Generator().manual_seed(0)
    q_len, slots = 5, 9
    query = torch.randn(2, 4, q_len, 8, generator=generator)
    key, value = (torch.randn(2, 2, slots, 8, generator=generator) for _ in range(2))
    if scored_by == "position_bias":
        scores = {"position_bias": torch.randn(2, 4, q_len, slots, generator=generator)}
        filled = {"position_bias": scores["position_bias"][..., :q_len]}
    else:  # each query's three lowest-numbered keys
        scores = {"indices": torch.arange(3).expand(2, q_len, 3)}
        filled = scores
    layer = _Layer().eval()
    flags = {"use_flash_attention": use_flash_attention}
    found, _ = attention.gaudi_attention_forward(layer, query, key, value, None, **scores, **flags)
    expected, _ = attention.gaudi_attention_forward(
        layer, query, key[:, :, :q_len], value[:, :, :q_len], None, **filled, **flags
    )
    torch.testing.assert_close(found, expected, atol=1e-6, rtol=0)
