"""The flag reaches the kernel by every route, with the documented precedence, and invalid settings are refused."""

import copy

import pytest
import torch

from optimum.habana import GaudiGenerationConfig, GaudiLlamaForCausalLM
from optimum.habana.kernels import variable_length
from optimum.habana.transformers import attention
from optimum.habana.transformers.attention_flags import resolve_attention_flags
from tests.helpers import FUSED_KERNEL_CPU, count_attention_paths, tiny_llama_config


NEW_TOKENS = 3
LAYERS = 2
# Prefill plus one decode step per new token after the first, in every layer.
ATTENTION_CALLS = LAYERS * NEW_TOKENS


@pytest.fixture(scope="module")
def model() -> GaudiLlamaForCausalLM:
    torch.manual_seed(0)
    return GaudiLlamaForCausalLM(tiny_llama_config(num_hidden_layers=LAYERS)).eval()


@pytest.fixture
def inputs() -> dict[str, torch.Tensor]:
    input_ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.fixture
def model_default(model):
    """Restore the model's generation config after a test that sets a per-model default."""
    saved = model.generation_config
    model.generation_config = GaudiGenerationConfig.from_dict(saved.to_dict())
    yield model.generation_config
    model.generation_config = saved


def generate(model, inputs, **kwargs) -> torch.Tensor:
    return model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


def assert_all_fused(counts) -> None:
    assert counts["fused"] == ATTENTION_CALLS
    assert counts["default"] == 0
    assert counts[FUSED_KERNEL_CPU] == ATTENTION_CALLS


def assert_none_fused(counts) -> None:
    assert counts["default"] == ATTENTION_CALLS
    assert counts["fused"] == 0
    assert counts[FUSED_KERNEL_CPU] == 0


def test_forward_kwarg(model, inputs, monkeypatch):
    with count_attention_paths(monkeypatch) as counts:
        model(**inputs, use_flash_attention=True)
    assert counts["fused"] == counts[FUSED_KERNEL_CPU] == LAYERS and counts["default"] == 0
    with count_attention_paths(monkeypatch) as counts:
        model(**inputs)
    assert counts["default"] == LAYERS and counts["fused"] == 0


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_generate_kwarg(model, inputs, monkeypatch, cache_implementation):
    with count_attention_paths(monkeypatch) as counts:
        generate(model, inputs, use_flash_attention=True, cache_implementation=cache_implementation)
    assert_all_fused(counts)
    with count_attention_paths(monkeypatch) as counts:
        generate(model, inputs, use_flash_attention=False, cache_implementation=cache_implementation)
    assert_none_fused(counts)


def test_generation_config_argument(model, inputs, monkeypatch):
    config = GaudiGenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, use_flash_attention=True)
    with count_attention_paths(monkeypatch) as counts:
        model.generate(**inputs, generation_config=config)
    assert_all_fused(counts)
    # The argument is not modified: a later call without it runs the model's default.
    assert config.use_flash_attention is True
    with count_attention_paths(monkeypatch) as counts:
        generate(model, inputs)
    assert_none_fused(counts)


def test_model_generation_config_and_per_call_override(model, inputs, model_default, monkeypatch):
    model_default.use_flash_attention = True
    with count_attention_paths(monkeypatch) as counts:
        generate(model, inputs)
    assert_all_fused(counts)
    with count_attention_paths(monkeypatch) as counts:
        generate(model, inputs, cache_implementation="static")
    assert_all_fused(counts)
    with count_attention_paths(monkeypatch) as counts:
        model(**inputs)  # forward without the kwarg follows the model's default too
    assert counts["fused"] == LAYERS and counts["default"] == 0

    # A per-call value wins, for that call only.
    with count_attention_paths(monkeypatch) as counts:
        generate(model, inputs, use_flash_attention=False)
    assert_none_fused(counts)
    with count_attention_paths(monkeypatch) as counts:
        model(**inputs, use_flash_attention=False)
    assert counts["default"] == LAYERS and counts["fused"] == 0
    with count_attention_paths(monkeypatch) as counts:
        generate(model, inputs)
    assert_all_fused(counts)


def test_passed_config_beats_model_config_and_kwarg_beats_both(model, inputs, model_default, monkeypatch):
    model_default.use_flash_attention = True
    off = GaudiGenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, use_flash_attention=False)
    with count_attention_paths(monkeypatch) as counts:
        model.generate(**inputs, generation_config=off)
    assert_none_fused(counts)
    with count_attention_paths(monkeypatch) as counts:
        model.generate(**inputs, generation_config=off, use_flash_attention=True)
    assert_all_fused(counts)
    # A passed config that leaves the flag unset inherits the model's value, like transformers' own fields.
    unset = GaudiGenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    with count_attention_paths(monkeypatch) as counts:
        model.generate(**inputs, generation_config=unset)
    assert_all_fused(counts)


def test_companion_flags_reach_the_kernel_by_every_route(model, inputs, model_default, monkeypatch):
    """The companions travel with the flag: spy on the kernel dispatch's arguments."""
    seen = []

    def spy(query, key, value, attn_mask, **kwargs):
        seen.append({"attn_mask": attn_mask, **kwargs})
        return real(query, key, value, attn_mask, **kwargs)

    real = attention.fused_sdpa
    monkeypatch.setattr(attention, "fused_sdpa", spy)
    monkeypatch.setattr(variable_length, "fused_sdpa", spy)
    flags = {"use_flash_attention": True, "flash_attention_recompute": True, "flash_attention_causal_mask": True}

    generate(model, inputs, **flags)
    config = GaudiGenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **flags)
    model.generate(**inputs, generation_config=config)
    for name, value in flags.items():
        setattr(model_default, name, value)
    generate(model, inputs)

    assert len(seen) == 3 * ATTENTION_CALLS
    # Prefill: causal over the real tokens, without a mask (on Gaudi with valid lengths: tests/core/test_hpu_kernel.py).
    prefills = [call for call in seen if call["is_causal"]]
    assert len(prefills) == 3 * LAYERS
    assert all(call["recompute"] is True and call["attn_mask"] is None for call in prefills)
    decodes = [call for call in seen if not call["is_causal"]]
    assert all(call["recompute"] is False and call["attn_mask"] is not None for call in decodes)


def test_config_round_trip(tmp_path, model):
    flags = {
        "use_flash_attention": True,
        "flash_attention_recompute": True,
        "flash_attention_causal_mask": True,
        "flash_attention_fast_softmax": True,
        "attn_softmax_bf16": False,
    }
    GaudiGenerationConfig(**flags).save_pretrained(tmp_path / "config")
    loaded = GaudiGenerationConfig.from_pretrained(tmp_path / "config")
    assert {name: getattr(loaded, name) for name in flags} == flags

    for name, value in flags.items():
        setattr(model.generation_config, name, value)
    try:
        model.save_pretrained(tmp_path / "model")
    finally:
        for name in flags:
            setattr(model.generation_config, name, None)
    reloaded = GaudiLlamaForCausalLM.from_pretrained(tmp_path / "model")
    assert isinstance(reloaded.generation_config, GaudiGenerationConfig)
    assert {name: getattr(reloaded.generation_config, name) for name in flags} == flags
    assert reloaded.config._attn_implementation == "sdpa"  # stock's default name; the flags came back


@pytest.mark.parametrize(
    "companion", ["flash_attention_recompute", "flash_attention_causal_mask", "flash_attention_fast_softmax"]
)
def test_companion_without_flag_is_an_error(model, inputs, companion):
    message = f"`{companion}` requires `use_flash_attention`"
    with pytest.raises(ValueError, match=message):
        GaudiGenerationConfig(**{companion: True})
    with pytest.raises(ValueError, match=message):
        generate(model, inputs, **{companion: True})
    with pytest.raises(ValueError, match=message):
        model(**inputs, **{companion: True})
    with pytest.raises(ValueError, match=message):
        model.generate(
            **inputs, generation_config=GaudiGenerationConfig(use_flash_attention=False), **{companion: True}
        )


def test_a_models_companion_serves_the_calls_that_turn_the_flag_on(model, inputs, model_default, monkeypatch):
    """A companion as the model's default, the flag per call (a higher-priority route): forward and generate alike."""
    model_default.flash_attention_recompute = True
    recompute = []
    real = attention.fused_sdpa

    def spy(query, key, value, attn_mask, **kwargs):
        recompute.append(kwargs["recompute"])
        return real(query, key, value, attn_mask, **kwargs)

    monkeypatch.setattr(attention, "fused_sdpa", spy)
    monkeypatch.setattr(variable_length, "fused_sdpa", spy)  # the padded prompt's calls
    generate(model, inputs, use_flash_attention=True)
    config = GaudiGenerationConfig(use_flash_attention=True, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    model.generate(**inputs, generation_config=config)
    prefills = recompute[:LAYERS] + recompute[ATTENTION_CALLS : ATTENTION_CALLS + LAYERS]
    assert len(recompute) == 2 * ATTENTION_CALLS and prefills == [True] * 2 * LAYERS
    with pytest.raises(ValueError, match="`flash_attention_recompute` requires `use_flash_attention`"):
        generate(model, inputs)  # the default alone is still no valid setting


def test_turning_flash_off_per_call_drops_the_models_companions(model, inputs, model_default, monkeypatch):
    model_default.use_flash_attention = True
    model_default.flash_attention_recompute = True
    with count_attention_paths(monkeypatch) as counts:
        generate(model, inputs, use_flash_attention=False)
    assert_none_fused(counts)


def test_softmax_bf16_with_flash_applies_to_the_calls_on_the_default_path(model, inputs, monkeypatch):
    """Accepted (Optimum-Habana's command lines combine them): fused calls ignore it, default-path calls use it."""
    GaudiGenerationConfig(use_flash_attention=True, attn_softmax_bf16=True)  # no error
    softmax_dtypes = []
    default_path = attention.matmul_softmax_attention

    def spy(query, key, value, mask, scaling, dropout, softmax_dtype, **kwargs):
        softmax_dtypes.append(softmax_dtype)
        return default_path(query, key, value, mask, scaling, dropout, softmax_dtype, **kwargs)

    monkeypatch.setattr(attention, "matmul_softmax_attention", spy)
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="attn_softmax_bf16 with use_flash_attention: the fused kernel computes"):
        flash = generate(bf16_model, inputs, use_flash_attention=True, attn_softmax_bf16=True)
    assert softmax_dtypes == []  # every call was fused
    assert torch.equal(flash, generate(bf16_model, inputs, use_flash_attention=True))
    # A call that takes the default path (attention weights asked for) gets the bf16 softmax.
    bf16_model(**inputs, use_flash_attention=True, attn_softmax_bf16=True, output_attentions=True)
    assert softmax_dtypes and set(softmax_dtypes) == {torch.bfloat16}


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_non_boolean_flag_is_an_error(model, inputs, value):
    with pytest.raises(ValueError, match=r"`use_flash_attention` must be True or False"):
        GaudiGenerationConfig(use_flash_attention=value)
    with pytest.raises(ValueError, match=r"`use_flash_attention` must be True or False"):
        generate(model, inputs, use_flash_attention=value)
    with pytest.raises(ValueError, match=r"`flash_attention_recompute` must be True or False"):
        resolve_attention_flags({"flash_attention_recompute": value})


class NamesItsInputsOnly(GaudiLlamaForCausalLM):
    """A user's subclass whose step inputs are the ones it names: generate()'s other keyword arguments stop here."""

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, **kwargs):
        if past_key_values is not None and past_key_values.get_seq_length() > 0:
            input_ids = input_ids[:, -1:]
        return {"input_ids": input_ids, "past_key_values": past_key_values, "attention_mask": attention_mask}


class HandsItsKwargsOn(GaudiLlamaForCausalLM):
    """A user's override that hands every keyword on: generate()'s own bookkeeping (`is_first_iteration`,
    `next_sequence_length`) reaches forward with the flags, as stock's attention functions ignore it."""

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        return {**kwargs, **inputs}  # what the method prepared, and every keyword it did not


def test_flags_a_subclass_would_drop_on_the_way_to_forward_are_an_error_not_a_no_op(model, inputs, monkeypatch):
    """Its steps would run on the model's own flags (off) while the call asked for the fused path: refused before
    anything is generated (not with continuous batching, whose steps do not go through the method). Flags that equal the model's own arrive either way; a subclass that hands its keywords
    on gets the call's, and the Gaudi class's logits at every step."""
    dropping = NamesItsInputsOnly(tiny_llama_config(num_hidden_layers=LAYERS)).eval()
    dropping.load_state_dict(model.state_dict())
    with pytest.raises(
        ValueError, match=r"NamesItsInputsOnly\.prepare_inputs_for_generation hands each step only"
    ) as error:
        dropping.generate(**inputs, max_new_tokens=NEW_TOKENS, use_flash_attention=True)
    assert "use_flash_attention=True" in str(error.value) and "model.generation_config" in str(error.value)
    with count_attention_paths(monkeypatch) as counts:  # continuous batching's steps take no such inputs: no error
        dropping.generate(
            inputs["input_ids"][:1], max_new_tokens=2, cache_implementation="paged", use_flash_attention=True
        )
    assert counts["fused"] > 0 and counts["default"] == 0
    dropping.generation_config.use_flash_attention = True  # the model's own: what its forward runs on anyway
    with count_attention_paths(monkeypatch) as counts:
        dropping.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, use_flash_attention=True)
    assert counts["fused"] == ATTENTION_CALLS and counts["default"] == 0
    handing = HandsItsKwargsOn(tiny_llama_config(num_hidden_layers=LAYERS)).eval()
    handing.load_state_dict(model.state_dict())
    steps = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "use_flash_attention": True}
    steps |= {"output_logits": True, "return_dict_in_generate": True}
    with count_attention_paths(monkeypatch) as counts:
        handed = handing.generate(**inputs, **steps)
    assert counts["fused"] == ATTENTION_CALLS and counts["default"] == 0
    plain = model.generate(**inputs, **steps)
    for found, expected in zip(handed.logits, plain.logits, strict=True):  # the prompt's position, then every step
        assert (found - expected).abs().max() <= 1e-5
