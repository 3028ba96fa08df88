"""The HPU path, through a test double of `habana_frameworks`: exact FusedSDPA arguments per phase and version."""

import sys
import types
import warnings

import pytest
import torch

from optimum.habana import GaudiLlamaForCausalLM, gaudi_model_class, hpu
from optimum.habana.kernels import dispatch
from optimum.habana.transformers.models import family_report
from tests.core import fake_habana
from tests.helpers import build_pair, left_padded_batch, tiny_llama_config


LAYERS = 2
NEW_TOKENS = 3
HEAD_DIM = 16  # hidden 64 over 4 heads
HEADS, KV_HEADS = 4, 2


@pytest.fixture(scope="module")
def model() -> GaudiLlamaForCausalLM:
    torch.manual_seed(0)
    return GaudiLlamaForCausalLM(tiny_llama_config(num_hidden_layers=LAYERS, initializer_range=0.1)).eval()


def gaudi(monkeypatch, version: str = "1.18") -> fake_habana.FakeHabana:
    """Install the double and treat the (CPU) test tensors as HPU tensors."""
    state = fake_habana.install(monkeypatch, version)
    hpu.hpu_kernel.cache_clear()
    fake_habana.treat_tensors_as_hpu(monkeypatch)
    return state


@pytest.fixture(autouse=True)
def clear_kernel_cache():
    yield
    hpu.hpu_kernel.cache_clear()


def batch(lengths: list[int]) -> dict[str, torch.Tensor]:
    return left_padded_batch(lengths, seed=7)


def greedy(model, inputs, **kwargs) -> torch.Tensor:
    return model.generate(
        **inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **kwargs
    )


def split_phases(calls):
    """A decode step stacks each key/value head's query group as its rows: [B, 2 kv heads, 2 groups, D]."""
    prefill = [call for call in calls if call.query.shape[1] == HEADS]
    decode = [call for call in calls if call.query.shape[1] == KV_HEADS]
    assert len(prefill) == LAYERS and len(decode) == LAYERS * (NEW_TOKENS - 1)
    return prefill, decode


def test_prefill_and_decode_arguments_without_padding(model, monkeypatch):
    state = gaudi(monkeypatch)
    greedy(model, batch([9, 9]), use_flash_attention=True)
    prefill, decode = split_phases(state.calls)
    for call in prefill:
        assert call.positional_count == 8
        assert call.arguments == {
            "attn_mask": None,
            "dropout_p": 0.0,
            "is_causal": True,
            "scale": HEAD_DIM**-0.5,
            "softmax_mode": "None",
            "recompute_mode": False,
            "valid_seq_len": None,
            "seq_padding_type": "left",
        }
        # Grouped-query attention: k/v keep their 2 heads, the kernel handles the 4 query heads.
        assert call.query.shape[1] == 4 and call.key.shape[1] == call.value.shape[1] == 2
    for step, call in enumerate(decode):
        # On Gaudi generate() builds a static cache (shapes stay static): every step attends over its whole bucket
        # (here the 11 slots of prompt + new tokens), the empty slots masked out.
        filled = 9 + 1 + step // LAYERS
        mask = call.arguments["attn_mask"]
        assert call.arguments["is_causal"] is False and call.key.shape[2] == mask.shape[-1] == 9 + NEW_TOKENS - 1
        assert (mask[..., :filled] == 0).all() and (mask[..., filled:] == torch.finfo(mask.dtype).min).all()
        # Each key/value head is read once for its whole query group: the group's queries are its rows.
        assert call.query.shape[1:3] == (KV_HEADS, HEADS // KV_HEADS) and call.key.shape[1] == KV_HEADS


def test_fast_softmax_and_recompute_on_prefill_only(model, monkeypatch):
    state = gaudi(monkeypatch)
    greedy(
        model,
        batch([9, 5]),
        use_flash_attention=True,
        flash_attention_fast_softmax=True,
        flash_attention_recompute=True,
    )
    prefill, decode = split_phases(state.calls)
    for call in prefill:
        assert call.arguments["softmax_mode"] == "fast" and call.arguments["recompute_mode"] is True
        # Left padding without the causal-mask mode: the padding mask, additive, and no is_causal; over the static
        # cache's slots (prompt + new tokens), the empty ones masked.
        mask = call.arguments["attn_mask"]
        assert call.arguments["is_causal"] is False and mask.shape == (2, 1, 9, 11) and mask.dtype == torch.float32
        assert mask[1, 0, -1, :4].eq(torch.finfo(torch.float32).min).all() and mask[1, 0, -1, 4:9].eq(0).all()
        assert mask[..., 9:].eq(torch.finfo(torch.float32).min).all()
    for call in decode:
        assert call.arguments["softmax_mode"] == "None" and call.arguments["recompute_mode"] is False
        assert call.arguments["is_causal"] is False and call.arguments["attn_mask"].shape[-2] == 1


def test_causal_mask_mode_passes_int32_valid_lengths(model, monkeypatch):
    state = gaudi(monkeypatch)
    greedy(model, batch([9, 6]), use_flash_attention=True, flash_attention_causal_mask=True)
    prefill, decode = split_phases(state.calls)
    for call in prefill:
        assert call.arguments["attn_mask"] is None and call.arguments["is_causal"] is True
        assert call.arguments["valid_seq_len"].dtype == torch.int32
        assert call.arguments["valid_seq_len"].tolist() == [9, 6]
        assert call.arguments["seq_padding_type"] == "left"
    for call in decode:
        # The decode step still needs the mask to skip the padding; valid lengths describe prompts only.
        assert call.arguments["valid_seq_len"] is None and call.arguments["attn_mask"] is not None


@pytest.mark.parametrize("version", ["1.16", "1.13"])
def test_older_gaudi_software_gets_its_own_argument_list(model, monkeypatch, version):
    state = gaudi(monkeypatch, version)
    greedy(model, batch([9, 9]), use_flash_attention=True, flash_attention_recompute=True)
    prefill, decode = split_phases(state.calls)
    expected_count = len(fake_habana.SIGNATURES[version])
    assert all(call.positional_count == expected_count for call in state.calls)
    # Recompute goes through the sdp_kernel context manager: on for prefill, off for decode.
    assert [call.recompute_context for call in prefill] == [True] * LAYERS
    assert all(call.recompute_context is False for call in decode)
    if version == "1.16":
        assert all(call.arguments["softmax_mode"] == "None" for call in state.calls)


def test_old_software_with_causal_mask_mode_and_padding_warns_and_stays_correct(model, monkeypatch):
    inputs = batch([9, 6])
    expected = greedy(model, inputs)
    state = gaudi(monkeypatch, "1.16")
    dispatch.warn_once.cache_clear()
    with pytest.warns(UserWarning, match="needs Gaudi software 1.18") as record:
        tokens = greedy(model, inputs, use_flash_attention=True, flash_attention_causal_mask=True)
    assert len([warning for warning in record if "1.18" in str(warning.message)]) == 1
    assert torch.equal(tokens, expected)
    # The padded prompt ran on the default path, the decode steps on the kernel.
    assert len(state.calls) == LAYERS * (NEW_TOKENS - 1)


@pytest.mark.parametrize(
    "flags",
    [
        {"use_flash_attention": True},
        {"use_flash_attention": True, "flash_attention_causal_mask": True},
        {"use_flash_attention": True, "flash_attention_fast_softmax": True, "flash_attention_recompute": True},
    ],
    ids=["mask", "causal-mask mode", "fast softmax"],
)
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_generation_through_the_double_matches_the_default_path(model, monkeypatch, flags, cache_implementation):
    inputs = batch([9, 4, 7])
    expected = greedy(model, inputs, cache_implementation=cache_implementation)
    state = gaudi(monkeypatch)
    tokens = greedy(model, inputs, cache_implementation=cache_implementation, **flags)
    assert len(state.calls) == LAYERS * NEW_TOKENS
    assert torch.equal(tokens, expected)


def test_training_recompute_and_gradients(model, monkeypatch):
    """Backward flows through the kernel call; gradient checkpointing forces recompute on."""
    state = gaudi(monkeypatch)
    inputs = batch([9, 9])
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        loss = model(**inputs, labels=inputs["input_ids"], use_flash_attention=True).loss
        loss.backward()
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
        model.zero_grad()
    assert state.calls and all(call.arguments["recompute_mode"] is True for call in state.calls)


def test_fast_softmax_in_recompute_training_through_the_value_alone_takes_the_exact_softmax(model, monkeypatch):
    """LoRA on v_proj alone: the query and key need no gradient, the value does, and FusedSDPA trains (it raises for
    fast softmax with recompute and a mask). The padded batch's masked calls get the exact softmax, with one warning,
    and the value projections' gradients are the default path's."""
    inputs = batch([9, 6])
    trained = [parameter for name, parameter in model.named_parameters() if "v_proj" in name]

    def value_gradients(**flags) -> list[torch.Tensor]:
        model.train()
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        for parameter in trained:
            parameter.requires_grad_(True)
        try:
            model(**inputs, labels=inputs["input_ids"], **flags).loss.backward()
            return [parameter.grad.clone() for parameter in trained]
        finally:
            model.eval()
            model.zero_grad(set_to_none=True)
            for parameter in model.parameters():
                parameter.requires_grad_(True)

    expected = value_gradients()
    state = gaudi(monkeypatch)
    dispatch.warn_once.cache_clear()
    flags = {"flash_attention_fast_softmax": True, "flash_attention_recompute": True}
    with pytest.warns(UserWarning, match="fast softmax in recompute training needs is_causal") as record:
        gradients = value_gradients(use_flash_attention=True, **flags)
    assert len([warning for warning in record if "fast softmax" in str(warning.message)]) == 1
    masked = [call for call in state.calls if not call.arguments["is_causal"]]
    assert masked and all(call.arguments["softmax_mode"] == "None" for call in masked)
    for got, want in zip(gradients, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_hpu_tensors_without_the_gaudi_software_fall_back_with_one_warning(model, monkeypatch):
    fake_habana.treat_tensors_as_hpu(monkeypatch)
    monkeypatch.setattr(hpu, "hpu_kernel", lambda: None)
    monkeypatch.setattr(dispatch, "hpu_kernel", lambda: None)
    inputs = batch([9, 5])
    expected = greedy(model, inputs)
    dispatch.warn_once.cache_clear()
    with pytest.warns(UserWarning, match="habana_frameworks cannot be imported") as record:
        tokens = greedy(model, inputs, use_flash_attention=True)
    assert len(record) == 1
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize(
    "flags",
    [{"use_flash_attention": True}, {"use_flash_attention": True, "flash_attention_causal_mask": True}, {}],
    ids=["mask", "causal-mask mode", "default path"],
)
@pytest.mark.parametrize("cache_implementation", ["static", None])
@pytest.mark.parametrize("prompt_in_graph", [True, False], ids=["prompt and decode", "decode only"])
def test_hpu_graphs_record_no_host_read(model, monkeypatch, flags, cache_implementation, prompt_in_graph):
    """Gaudi's graph contract: a forward recorded into an HPU graph reads nothing on the host (the double fails the
    call at the first read). With a static cache, one graph serves the prompt and one every decode step."""
    inputs = batch([9, 4, 7])
    expected = greedy(model, inputs, cache_implementation=cache_implementation)
    state = gaudi(monkeypatch)
    graphed = GaudiLlamaForCausalLM(model.config).eval()
    graphed.load_state_dict(model.state_dict())
    graphed = hpu.wrap_in_hpu_graph(graphed, prompt_in_graph=prompt_in_graph)
    tokens = greedy(graphed, inputs, cache_implementation=cache_implementation, **flags)
    assert torch.equal(tokens, expected)
    if cache_implementation == "static":
        assert sorted(state.graphs.values()) == ([0, NEW_TOKENS - 2] if prompt_in_graph else [NEW_TOKENS - 2])


@pytest.mark.parametrize(
    "family, local",
    [
        ("mistral", {"sliding_window": 5}),
        ("gemma3_text", {"sliding_window": 5, "sliding_window_pattern": 2}),
        ("llama4_text", {"attention_chunk_size": 5}),
    ],
    ids=["sliding window", "alternating windows", "chunks"],
)
def test_hpu_graphs_replay_decode_steps_past_a_window(monkeypatch, family, local):
    """A replayed graph runs no Python: the double replays with the caches' Python numbers as they were recorded.
    transformers' static window layers count their tokens in Python inside the forward (one branch to fill, another
    to roll); on Gaudi the cache's window layers hold the whole length and the mask applies the window, so the steps
    past the window are the default path's, logits included."""
    ours, _ = build_pair(family, **local)
    inputs = batch([4, 7, 6])
    settings = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    settings |= {"output_logits": True, "return_dict_in_generate": True}
    expected = ours.generate(**inputs, **settings)
    state = gaudi(monkeypatch)
    graphed = gaudi_model_class(family)(ours.config).eval()
    graphed.load_state_dict(ours.state_dict())
    graphed = hpu.wrap_in_hpu_graph(graphed)
    found = graphed.generate(**inputs, **settings, use_flash_attention=True)
    assert sorted(state.graphs.values()) == [0, 4]  # the prompt's graph, and one decode graph replayed 4 times
    assert torch.equal(found.sequences, expected.sequences)
    for step, (logits, reference) in enumerate(zip(found.logits, expected.logits, strict=True)):
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("cache_implementation", [None, "static"], ids=["default cache", "static"])
def test_a_decode_step_writes_the_cache_in_place_and_only_the_kernel_reads_it(
    model, monkeypatch, cache_implementation
):
    """Gaudi's rules for a decode step, by construction: static shapes (generate()'s default cache there is static),
    the new token written into the cache's storage in place (two index copies a layer, nothing else touches it),
    and the cache read once, by FusedSDPA, from views of that storage, each key/value head once for its group."""
    state = gaudi(monkeypatch)
    steps = []

    def watch_decode_steps(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            layers = kwargs["past_key_values"].layers
            storages = {
                tensor.untyped_storage().data_ptr() for layer in layers for tensor in (layer.keys, layer.values)
            }
            steps.append(fake_habana.CacheAccesses(state, storages))
            steps[-1].__enter__()

    def stop_watching(module, args, kwargs, output):
        if steps and kwargs["input_ids"].shape[1] == 1:
            steps[-1].__exit__(None, None, None)

    hooks = [
        model.register_forward_pre_hook(watch_decode_steps, with_kwargs=True),
        model.register_forward_hook(stop_watching, with_kwargs=True),
    ]
    try:
        greedy(model, batch([9, 5]), use_flash_attention=True, cache_implementation=cache_implementation)
    finally:
        for hook in hooks:
            hook.remove()
    _, decode = split_phases(state.calls)
    assert len(steps) == NEW_TOKENS - 1
    assert all(step.storages == steps[0].storages for step in steps)  # the same storage every step: no copy
    for step in steps:
        assert step.counts == {"aten::index_copy_": 2 * LAYERS}
    for call in decode:
        assert {call.key.untyped_storage().data_ptr(), call.value.untyped_storage().data_ptr()} <= steps[0].storages
        assert call.key.shape[2] == 9 + NEW_TOKENS - 1  # the same shape every step
        assert call.query.shape[1:3] == (KV_HEADS, HEADS // KV_HEADS)


def test_a_right_padded_prompt_continues_from_its_last_position_as_the_default_path_does(model, monkeypatch):
    """The causal valid-length call leaves the padding's outputs zero; the last position, which generate()
    continues from, gets one more call: its query over the row's real keys, as stock's mask gives it."""
    inputs = batch([9, 6])
    order = torch.argsort(1 - inputs["attention_mask"], dim=1, stable=True)
    inputs = {name: tensor.gather(1, order) for name, tensor in inputs.items()}  # the padding on the right
    expected = greedy(model, inputs)
    state = gaudi(monkeypatch)
    tokens = greedy(model, inputs, use_flash_attention=True, flash_attention_causal_mask=True)
    assert torch.equal(tokens, expected)
    prompt = state.calls[: 2 * LAYERS]
    for causal, last in zip(prompt[0::2], prompt[1::2], strict=True):
        assert causal.arguments["is_causal"] is True and causal.arguments["attn_mask"] is None
        assert causal.arguments["valid_seq_len"].tolist() == [9, 6] and causal.arguments["seq_padding_type"] == "right"
        mask = last.arguments["attn_mask"]
        assert last.query.shape == (2, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM) and mask.shape == (2, 1, 1, 9)
        assert last.arguments["is_causal"] is False and last.arguments["valid_seq_len"] is None
        assert mask[0].eq(0).all() and mask[1, ..., :6].eq(0).all()
        assert mask[1, ..., 6:].eq(torch.finfo(torch.float32).min).all()
    assert len(state.calls) == 2 * LAYERS + LAYERS * (NEW_TOKENS - 1)


@pytest.mark.parametrize(
    ("model_type", "local_layer", "extent"),
    [
        ("mistral", "sliding_attention", "a sliding window of 8 tokens"),
        ("gpt_oss", "sliding_attention", "a sliding window of 8 tokens"),
        ("llama4_text", "chunked_attention", "chunks of 8 tokens"),
    ],
)
def test_generate_in_the_causal_mask_mode_gives_windowed_families_valid_lengths(
    model_type, local_layer, extent, monkeypatch
):
    """generate() hands the prompt's 2-D mask on in the causal-mask mode, as in a forward: every prompt call within
    its window or chunk takes FusedSDPA's valid lengths, a longer prompt's windowed layers keep transformers' mask
    (one line says so), and every step's logits are stock's. It once kept generate()'s 4-D masks: no valid lengths
    for any layer of these families, and not a word."""
    from tests.families.support import assert_same_steps, family_pair
    from tests.families.support import greedy as greedy_steps

    ours, stock = family_pair(model_type)
    version = "1.18-sinks" if model_type == "gpt_oss" else "1.18"
    layer_types = getattr(ours.config, "layer_types", None) or [local_layer] * ours.config.num_hidden_layers
    (attention_class,) = family_report(model_type).attention_classes
    for lengths in ([7, 5, 6], [12, 5, 9]):  # within the tiny windows and chunks (8 tokens), then past them
        inputs = left_padded_batch(lengths, seed=7)
        state = gaudi(monkeypatch, version)
        dispatch.warn_once.cache_clear()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            steps = greedy_steps(ours, inputs, use_flash_attention=True, flash_attention_causal_mask=True)
        monkeypatch.undo()
        assert_same_steps(steps, greedy_steps(stock, inputs))
        prompt = [call for call in state.calls if call.query.shape[2] == max(lengths)]
        assert len(prompt) == len(layer_types)
        for call, layer_type in zip(prompt, layer_types, strict=True):
            planned = max(lengths) <= 8 or layer_type == "full_attention"
            assert (call.arguments["valid_seq_len"] is not None) == planned, (lengths, layer_type)
            assert (call.arguments["attn_mask"] is None) == planned, (lengths, layer_type)
        said = [str(warning.message) for warning in record if "flash_attention_causal_mask" in str(warning.message)]
        kept = "chunks" if local_layer == "chunked_attention" else "window"
        line = (
            f"flash_attention_causal_mask: {attention_class} attends within {extent}, shorter than this prompt (12); "
            f"its layers read the mask to keep the {kept}."
        )
        assert said == ([] if max(lengths) <= 8 else [line])


def test_gaudi_software_without_fusedsdpa_is_named_in_the_one_warning(model, monkeypatch):
    """Not "habana_frameworks cannot be imported": the package imports, its kernels module lacks FusedSDPA."""
    gaudi(monkeypatch)
    kernels = types.ModuleType("habana_frameworks.torch.hpex.kernels")
    monkeypatch.setitem(sys.modules, kernels.__name__, kernels)
    monkeypatch.setattr(sys.modules["habana_frameworks.torch.hpex"], "kernels", kernels)
    hpu.hpu_kernel.cache_clear()
    hpu.missing_kernel.cache_clear()
    inputs = batch([9, 5])
    expected = greedy(model, inputs)
    dispatch.warn_once.cache_clear()
    with pytest.warns(UserWarning) as record:
        tokens = greedy(model, inputs, use_flash_attention=True)
    hpu.missing_kernel.cache_clear()
    (warning,) = record
    assert (
        "tensors are on HPU but the installed Gaudi software has no habana_frameworks.torch.hpex.kernels.FusedSDPA"
        in str(warning.message)
    )
    assert torch.equal(tokens, expected)


def test_continuous_batching_decode_steps_stay_exact_and_keep_no_probabilities(monkeypatch):
    """An engine step of one new token per sequence stacks the sequences' decode steps as its query rows: those get
    the exact softmax and no recompute, as generate()'s decode steps do; its prompts the companions. They once took
    the rows for a prompt (more than one query): every multi-sequence decode step on Gaudi ran the fast softmax."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.utils import is_torch_hpu_available

    from optimum.habana.transformers import continuous_batching

    is_torch_hpu_available()  # transformers' answer, cached before the double (a module without a spec) is in place
    state = gaudi(monkeypatch)
    on_cpu = continuous_batching.steps_run_mask_free  # on a card the model is on "hpu": the engine builds its mask
    monkeypatch.setattr(
        continuous_batching, "steps_run_mask_free", lambda flag, config, device: on_cpu(flag, config, "hpu")
    )
    torch.manual_seed(0)
    model = GaudiLlamaForCausalLM(tiny_llama_config(num_hidden_layers=1, initializer_range=0.1)).eval()
    flags = {"use_flash_attention": True, "flash_attention_fast_softmax": True, "flash_attention_recompute": True}
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0, **flags)
    engine = ContinuousBatchingConfig(num_blocks=16, page_size=16, max_batch_tokens=64)
    results = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=engine)
    expected = model.generate(torch.tensor(prompts), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert [results[key].generated_tokens for key in sorted(results)] == expected[:, 5:].tolist()
    calls = [
        (call.query.shape[2], call.arguments["softmax_mode"], call.arguments["recompute_mode"]) for call in state.calls
    ]
    assert calls == [(15, "fast", True), (3, "None", False), (3, "None", False), (3, "None", False)]


def test_a_family_without_a_static_cache_keeps_the_dynamic_one_on_gaudi_with_one_warning(monkeypatch):
    """On Gaudi generate() builds a bucketed static cache; transformers builds no static cache for DeepSeek V4 (its
    compressed layers have no static kind), where the replacement failed with a KeyError from inside transformers and
    stock's class generated. It now keeps the dynamic cache, says so once, and every step's logits are stock's."""
    from tests.families.support import assert_same_steps, family_pair
    from tests.families.support import greedy as greedy_steps

    ours, stock = family_pair("deepseek_v4")
    inputs = left_padded_batch([7, 5, 6], seed=7)
    gaudi(monkeypatch, "1.18-sinks")
    dispatch.warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        steps = greedy_steps(ours, inputs, use_flash_attention=True)
    monkeypatch.undo()
    assert_same_steps(steps, greedy_steps(stock, inputs))
    said = [str(warning.message) for warning in record if "no static KV cache" in str(warning.message)]
    assert said == [
        "transformers has no static KV cache for deepseek_v4 models (no static layer for their "
        "'compressed_sparse_attention', 'heavily_compressed_attention' layers): generate() keeps the dynamic cache "
        "on Gaudi, one graph per decode step's shape."
    ]


@pytest.mark.parametrize("model_type", ["zamba2", "nemotron_h", "opt", "moshi"])
def test_a_padded_forward_on_gaudi_keeps_the_familys_own_masks_where_they_are_not_transformers_alone(
    model_type, monkeypatch
):
    """On Gaudi a 2-D mask is turned into transformers' 4-D masks before the layers (no host read for an HPU graph);
    where the family's decoder does more with it that failed: hybrids' `hybrid`/`mlp` layer types have no single mask
    builder (a TypeError or KeyError), OPT counts its positions from the 2-D mask (a shape error), Moshi's config
    window is applied by no layer (every logit wrong). Those keep the 2-D mask, as stock does."""
    from tests.families.support import family_pair

    ours, stock = family_pair(model_type)
    inputs = left_padded_batch([12, 5, 9], seed=7)
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        expected = stock(**inputs).logits[real]
        gaudi(monkeypatch)
        for flags in ({}, {"use_flash_attention": True}):
            torch.testing.assert_close(ours(**inputs, **flags).logits[real], expected, rtol=1e-4, atol=1e-4)
