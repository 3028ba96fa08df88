"""transformers' continuous batching on the Gaudi classes: every family, with and without the flag.

Each request's greedy fp32 tokens equal its own `generate()` and stock transformers' continuous batching with
`sdpa`; with the flag every attention call of every engine step (prefill chunks and decode) runs the fused kernel
over the paged cache; the user's `attn_implementation` and flags come back unchanged when the manager stops; and a
request the engine cannot serve fails alone, with its reason.
"""

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.requests import RequestStatus

from optimum.habana.transformers import attention
from tests.helpers import (
    FAMILIES,
    SLIDING_WINDOW_CONFIGS,
    SOFT_CAPPED,
    build_pair,
    count_attention_paths,
    in_make_test,
)


LENGTHS = (5, 9, 3, 12)  # mixed lengths, some past the 5-token sliding windows
NEW_TOKENS = 6


def small_engine() -> ContinuousBatchingConfig:
    """A paged cache sized for these requests: sized from free memory by default, it takes seconds to allocate."""
    return ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=64)


def prompts(seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length,), generator=generator).tolist() for length in LENGTHS]


def greedy_config(**overrides) -> GenerationConfig:
    values = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "eos_token_id": -1, "pad_token_id": 0}
    return GenerationConfig(**{**values, **overrides})


def by_request(outputs: dict) -> list[list[int]]:
    """Each request's tokens, in the order the prompts were added (ids req_0, req_1, ...)."""
    ordered = sorted(outputs.values(), key=lambda output: int(output.request_id.rsplit("_", 1)[-1]))
    return [output.generated_tokens for output in ordered]


def served_with_the_flag(model, requests: list[list[int]]) -> list[list[int]]:
    """Each request's greedy tokens from the engine (a small paged cache), the flag on."""
    outputs = model.generate_batch(
        inputs=requests,
        generation_config=greedy_config(use_flash_attention=True),
        continuous_batching_config=small_engine(),
    )
    return by_request(outputs)


def one_by_one(model, requests: list[list[int]], **kwargs) -> list[list[int]]:
    return [
        model.generate(torch.tensor([ids]), generation_config=greedy_config(), **kwargs)[0, len(ids) :].tolist()
        for ids in requests
    ]


def models(model_type: str, **overrides):
    return build_pair(model_type, **overrides)


# Llama, and Gemma 2 (soft-capped: the default path, and stock's engine on eager); the others under `families`, where
# tests/families/test_family_depth.py serves every family with the flag too
@pytest.mark.parametrize("model_type", in_make_test(FAMILIES, kept={"llama", "gemma2"}))
def test_generate_batch_matches_generate_and_stock_continuous_batching(model_type, monkeypatch):
    ours, stock = models(model_type)
    if model_type not in SOFT_CAPPED:  # stock Gemma 2 has no sdpa: its engine runs "paged|eager"
        stock.set_attn_implementation("sdpa")
    requests = prompts()
    expected = one_by_one(ours, requests)
    stock_outputs = stock.generate_batch(
        inputs=requests, generation_config=greedy_config(), continuous_batching_config=small_engine()
    )
    assert by_request(stock_outputs) == expected
    for use_flash_attention in (False, True):
        ours.generation_config.use_flash_attention = use_flash_attention
        with count_attention_paths(monkeypatch, profile=False) as counts:
            outputs = ours.generate_batch(
                inputs=requests, generation_config=greedy_config(), continuous_batching_config=small_engine()
            )
        assert all(output.status == RequestStatus.FINISHED for output in outputs.values())
        assert by_request(outputs) == expected, f"use_flash_attention={use_flash_attention}"
        calls = counts["fused"] + counts["default"]
        assert calls > 0 and calls % ours.config.num_hidden_layers == 0  # every layer of every engine step
        if use_flash_attention and model_type not in SOFT_CAPPED:
            assert counts["default"] == 0
        else:
            assert counts["fused"] == 0


@pytest.mark.parametrize("model_type", SLIDING_WINDOW_CONFIGS)
def test_sliding_windows_hold_in_continuous_batching(model_type, monkeypatch):
    ours, _ = models(model_type, **SLIDING_WINDOW_CONFIGS[model_type])
    requests = prompts(1)
    assert served_with_the_flag(ours, requests) == one_by_one(ours, requests)


@pytest.mark.parametrize("implementation", ["eager", "sdpa", "gaudi_fused_sdpa", "gaudi"])
def test_any_loaded_attn_implementation_serves_and_comes_back(implementation, tmp_path, monkeypatch):
    ours, _ = models("llama")
    ours.save_pretrained(tmp_path)
    model = type(ours).from_pretrained(tmp_path, attn_implementation=implementation)
    model.generation_config.flash_attention_recompute = None
    flags_before = model.generation_config.to_dict()
    requests = prompts()
    expected = one_by_one(model, requests)
    with count_attention_paths(monkeypatch, profile=False) as counts:
        outputs = model.generate_batch(
            inputs=requests, generation_config=greedy_config(), continuous_batching_config=small_engine()
        )
    assert by_request(outputs) == expected
    fused = implementation in ("sdpa", "gaudi_fused_sdpa")  # the flag each one sets as the model's default
    assert (counts["fused"] > 0, counts["default"] > 0) == (fused, not fused)
    assert model.config._attn_implementation == implementation
    assert model.generation_config.to_dict() == flags_before


def test_the_given_generation_config_carries_the_flag(monkeypatch):
    ours, _ = models("llama")
    assert not ours.generation_config.use_flash_attention
    with count_attention_paths(monkeypatch, profile=False) as counts:
        ours.generate_batch(
            inputs=prompts(),
            generation_config=greedy_config(use_flash_attention=True),
            continuous_batching_config=small_engine(),
        )
    assert counts["fused"] > 0 and counts["default"] == 0
    with count_attention_paths(monkeypatch, profile=False) as counts:
        ours.generate_batch(
            inputs=prompts(), generation_config=greedy_config(), continuous_batching_config=small_engine()
        )
    assert counts["default"] > 0 and counts["fused"] == 0  # the model's own config again


def test_generate_batch_takes_the_flags_per_call_as_generate_does(monkeypatch):
    """Stock `generate_batch` keeps `max_new_tokens` of its keyword arguments and drops the rest: a flag given there
    (the README's "per call") ran the default path without a word. It overrides the given generation config's, and
    a misspelled one is named."""
    ours, _ = models("llama")
    config = greedy_config()
    with count_attention_paths(monkeypatch, profile=False) as counts:
        outputs = ours.generate_batch(
            inputs=prompts(),
            generation_config=config,
            continuous_batching_config=small_engine(),
            use_flash_attention=True,
        )
    assert counts["fused"] > 0 and counts["default"] == 0
    assert by_request(outputs) == one_by_one(ours, prompts(), use_flash_attention=True)
    assert not hasattr(config, "use_flash_attention") or not config.use_flash_attention  # the caller's, unchanged
    with count_attention_paths(monkeypatch, profile=False) as counts:
        ours.generate_batch(
            inputs=prompts(),
            generation_config=greedy_config(use_flash_attention=True),
            continuous_batching_config=small_engine(),
            use_flash_attention=False,
        )
    assert counts["default"] > 0 and counts["fused"] == 0
    with pytest.raises(TypeError, match="`use_flash_atention`.*did you mean `use_flash_attention`"):
        ours.generate_batch(inputs=prompts(), generation_config=config, use_flash_atention=True)


def test_manager_add_request_streaming_and_context_manager(monkeypatch):
    ours, _ = models("llama")
    requests = prompts()
    expected = one_by_one(ours, requests, use_flash_attention=True)
    config = greedy_config(use_flash_attention=True)
    with ours.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=small_engine()
    ) as manager:
        ids = [manager.add_request(ids, max_new_tokens=NEW_TOKENS) for ids in requests]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=5)
            if result is not None and result.is_finished():
                results[result.request_id] = result.generated_tokens
    assert [results[request_id] for request_id in ids] == expected
    manager = ours.init_continuous_batching(generation_config=config, continuous_batching_config=small_engine())
    manager.start()
    try:
        request_id = manager.add_request(requests[0], max_new_tokens=NEW_TOKENS, streaming=True)
        streamed = []
        for chunk in manager.request_id_iter(request_id):
            streamed = chunk.generated_tokens
            if chunk.is_finished():
                break
    finally:
        manager.stop(block=True)
    assert streamed == expected[0]
    assert ours.config._attn_implementation == "sdpa"  # what it was before the engine ran: stock's default


def test_a_request_that_cannot_be_served_fails_alone():
    ours, _ = models("llama")
    too_long = [3 + index % 250 for index in range(ours.config.max_position_embeddings + 10)]
    requests = [prompts()[0], too_long, [], prompts()[2]]
    outputs = ours.generate_batch(
        inputs=requests,
        generation_config=greedy_config(use_flash_attention=True),
        continuous_batching_config=small_engine(),
    )
    ordered = sorted(outputs.values(), key=lambda output: int(output.request_id.rsplit("_", 1)[-1]))
    statuses = [output.status for output in ordered]
    assert statuses == [RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.FAILED, RequestStatus.FINISHED]
    assert ordered[1].error == (
        "the prompt has 2058 tokens, as many as or more than the model's context of 2048 (max_position_embeddings): "
        "shorten it."
    )
    assert ordered[2].error == "empty prompt: there is nothing to continue; send at least one token."
    assert not ordered[1].generated_tokens and not ordered[2].generated_tokens
    expected = one_by_one(ours, [requests[0], requests[3]])
    assert [ordered[0].generated_tokens, ordered[3].generated_tokens] == expected


POISON = 250  # a token id the stand-in below fails on


def failing_on_poison(model, monkeypatch) -> None:
    """A stand-in for a request that fails inside the engine's step: the forward raises on a step holding POISON."""
    forward = model.forward

    def forward_or_fail(*args, **kwargs):
        if (kwargs.get("input_ids") == POISON).any():
            raise RuntimeError("poisoned step")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward_or_fail)


def finished(manager, request_id: str):
    while (result := manager.get_result(request_id=request_id, timeout=10)) is not None:
        if result.is_finished():
            return result
    raise AssertionError(f"{request_id} never finished")


@pytest.mark.parametrize("flag", [True, False])
def test_a_failed_step_fails_its_requests_and_the_engine_serves_the_next_ones(flag, monkeypatch):
    """transformers' loop dies on an exception in a step's forward (every later request fails, a server answers 503
    from then on); the Gaudi manager fails the step's requests, each with the error, and goes on."""
    ours, _ = models("llama")
    failing_on_poison(ours, monkeypatch)
    good = prompts()[:2]
    expected = one_by_one(ours, good, use_flash_attention=flag)
    manager = ours.init_continuous_batching(
        generation_config=greedy_config(use_flash_attention=flag), continuous_batching_config=small_engine()
    )
    manager.start()
    try:
        first = finished(manager, manager.add_request(good[0], max_new_tokens=NEW_TOKENS))
        poisoned = finished(manager, manager.add_request([7, POISON, 9], max_new_tokens=NEW_TOKENS))
        after = finished(manager, manager.add_request(good[1], max_new_tokens=NEW_TOKENS))
        assert manager.is_running()
    finally:
        manager.stop(block=True)
    assert poisoned.status == RequestStatus.FAILED and poisoned.error == "poisoned step"
    assert [first.status, after.status] == [RequestStatus.FINISHED] * 2
    assert [first.generated_tokens, after.generated_tokens] == expected


def test_a_bad_generation_option_fails_its_request_alone():
    ours, _ = models("llama")
    with ours.continuous_batching_context_manager(
        generation_config=greedy_config(), continuous_batching_config=small_engine()
    ) as manager:
        bad = manager.add_request(prompts()[0], max_new_tokens=-3)
        good = manager.add_request(prompts()[1], max_new_tokens=NEW_TOKENS)
        results = {}
        while len(results) < 2:
            result = manager.get_result(timeout=5)
            if result is not None and result.is_finished():
                results[result.request_id] = result
    assert results[bad].status == RequestStatus.FAILED
    assert results[bad].error == "max_new_tokens must be at least 1, got -3."
    assert results[good].generated_tokens == one_by_one(ours, [prompts()[1]])[0]


def test_other_cache_arguments_are_still_refused():
    ours, _ = models("llama")
    query = torch.zeros(1, 4, 2, 16)
    key = value = torch.zeros(1, 2, 2, 16)
    with pytest.raises(TypeError, match=r"does not know the argument\(s\) \['cache'\]"):
        attention.gaudi_attention_forward(ours.model.layers[0].self_attn, query, key, value, None, cache=object())


def test_the_flag_runs_each_sequence_over_its_own_keys():
    """Three sequences packed as the engine packs them: a prompt from an empty cache, a decode step, and a prompt
    chunk after cached tokens; then two queries of engine padding. Each output row equals the attention over its
    own sequence's keys under the engine's dense mask."""
    from optimum.habana.kernels.variable_length import Segment, segmented_sdpa
    from optimum.habana.transformers.batch_layout import paged_bounds, paged_segments

    shapes = [(5, 5), (1, 9), (4, 12)]  # (queries, keys) per sequence
    cu_q = torch.tensor([0, 5, 6, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 14, 26], dtype=torch.int32)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 12, 16, generator=generator)  # 10 real queries, 2 of padding
    key, value = (torch.randn(1, 2, 26, 16, generator=generator) for _ in range(2))

    dense = torch.zeros(12, 26, dtype=torch.bool)
    for (q_len, k_len), q_start, k_start in zip(shapes, cu_q.tolist(), cu_k.tolist(), strict=False):
        for row in range(q_len):
            dense[q_start + row, k_start : k_start + k_len - q_len + row + 1] = True
    expected = attention.matmul_softmax_attention(
        query, key, value, dense[None, None], 0.25, 0.0, torch.float32, softcap=None, is_causal=False
    )[0].transpose(1, 2)

    bounds = paged_bounds(cu_q, {"full_attention": cu_k})  # planned on the host: one call per sequence
    assert bounds == (Segment(0, 0, 5, 0, 5), Segment(0, 5, 6, 5, 14), Segment(0, 6, 10, 14, 26))
    segments = paged_segments(cu_q, cu_k, 12, 26)  # in a graph: tensors only, one call
    assert segments.query_ids.tolist() == [[0] * 5 + [1] + [2] * 4 + [-1] * 2]
    options = {"scale": 0.25, "dropout_p": 0.0, "fast_softmax": False, "recompute": False}
    for plan in (segments._replace(bounds=bounds), segments):
        output = segmented_sdpa(query, key, value, plan, **options)
        torch.testing.assert_close(output[:, :, :10], expected[:, :, :10], rtol=1e-5, atol=1e-5)
        assert torch.equal(output[:, :, 10:], torch.zeros(1, 4, 2, 16))


def test_long_prompts_in_chunks_next_to_decoding_requests_match_generate(monkeypatch):
    """Prompts longer than an engine step arrive in chunks after their own cached tokens, next to requests that
    decode: with the flag, every full-attention call runs one kernel call per scheduled sequence."""
    ours, _ = models("llama")
    requests = [torch.arange(5, 45).tolist(), [8, 9, 10], torch.arange(50, 70).tolist()]
    expected = one_by_one(ours, requests)
    engine = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=16)
    with count_attention_paths(monkeypatch, profile=False) as counts:
        outputs = ours.generate_batch(
            inputs=requests,
            generation_config=greedy_config(use_flash_attention=True),
            continuous_batching_config=engine,
        )
    assert by_request(outputs) == expected
    assert counts["default"] == 0 and counts["fused"] > 0


@pytest.mark.parametrize(
    ("model_type", "flag", "builds_mask"),
    [("llama", True, False), ("llama", False, True), ("mistral", True, True)],
    ids=["flag: no mask", "default path: mask", "sliding window: mask"],
)
def test_the_engine_builds_its_dense_mask_only_where_a_path_reads_it(model_type, flag, builds_mask, monkeypatch):
    """The dense [1, 1, q_total, kv_total] mask per step is skipped with the flag on a model whose layers all attend
    fully (the attention reads the step's boundaries); the default path and sliding windows read it."""
    from transformers.generation.continuous_batching import input_outputs

    ours, _ = models(model_type, **({"sliding_window": 4} if model_type == "mistral" else {}))
    built = []
    real = input_outputs.build_attention_mask
    monkeypatch.setattr(input_outputs, "build_attention_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    expected = one_by_one(ours, prompts())
    outputs = ours.generate_batch(
        inputs=prompts(),
        generation_config=greedy_config(use_flash_attention=flag),
        continuous_batching_config=small_engine(),
    )
    assert by_request(outputs) == expected
    assert bool(built) is builds_mask
    assert ours.config._attn_implementation == "sdpa"  # the user's choice is back once the manager stopped


@pytest.mark.parametrize("flag", [True, False])
def test_a_failed_request_fails_alone_beside_the_requests_of_its_step(flag, monkeypatch):
    """A request that fails in a step it shares with others (a stand-in: the forward raises on a step holding
    POISON): it fails with its error, each other request of the step finishes with generate()'s tokens, through
    `generate_batch` and the streaming manager alike (every request of the step failed with it before)."""
    ours, _ = models("llama")
    failing_on_poison(ours, monkeypatch)
    good = [[token for token in ids if token != POISON] for ids in prompts()]
    expected = one_by_one(ours, good, use_flash_attention=flag)
    requests = [good[0], [7, POISON, 9], *good[1:]]
    config = greedy_config(use_flash_attention=flag)
    outputs = ours.generate_batch(requests, generation_config=config, continuous_batching_config=small_engine())
    ordered = [outputs[f"req_{index}"] for index in range(len(requests))]
    assert ordered[1].status == RequestStatus.FAILED and ordered[1].error == "poisoned step"
    others = [output for index, output in enumerate(ordered) if index != 1]
    assert [output.status for output in others] == [RequestStatus.FINISHED] * len(good)
    assert [output.generated_tokens for output in others] == expected
    assert [output.prompt_ids for output in others] == good  # reported as sent, though tried again

    manager = ours.init_continuous_batching(generation_config=config, continuous_batching_config=small_engine())
    manager.start()
    try:
        ids = manager.add_requests(requests)
        done = {}
        while len(done) < len(ids) and (result := manager.get_result(timeout=10)) is not None:
            if result.is_finished():
                done[result.request_id] = result
        assert manager.is_running()
    finally:
        manager.stop(block=True)
    results = [done[request_id] for request_id in ids]
    assert results[1].status == RequestStatus.FAILED and results[1].error == "poisoned step"
    assert [result.generated_tokens for index, result in enumerate(results) if index != 1] == expected


def test_a_kept_manager_serves_each_call_with_its_own_flags(monkeypatch):
    """`persistent_manager=True` keeps the engine between calls. The flag off needs each step's mask, which an engine
    built for the flag left out: a call with other flags gets an engine built for them, one with the same flags the
    kept one."""
    ours, _ = models("llama")
    requests = prompts()
    engines = []
    try:
        for flag in (True, True, False, True):
            with count_attention_paths(monkeypatch, profile=False) as counts:
                outputs = ours.generate_batch(
                    inputs=requests,
                    generation_config=greedy_config(use_flash_attention=flag),
                    continuous_batching_config=small_engine(),
                    persistent_manager=True,
                )
            assert [output.status for output in outputs.values()] == [RequestStatus.FINISHED] * len(requests)
            assert by_request(outputs) == one_by_one(ours, requests, use_flash_attention=flag)
            assert counts["fused" if flag else "default"] > 0 and counts["default" if flag else "fused"] == 0
            engines.append(ours._cached_continuous_batching_manager.batch_processor)
    finally:
        ours.destroy_cached_continuous_batching_manager()
    assert engines[1] is engines[0] and engines[2] is not engines[1] and engines[3] is not engines[2]


def test_other_flags_for_a_kept_manager_still_running_are_refused():
    ours, _ = models("llama")
    manager = ours.init_continuous_batching(
        generation_config=greedy_config(use_flash_attention=True), continuous_batching_config=small_engine()
    )
    manager.start()
    manager.stop(block=True, keep_for_next_session=True)
    manager.start()  # kept on the model, and running again
    try:
        with pytest.raises(ValueError) as refused:
            ours.init_continuous_batching(generation_config=greedy_config(use_flash_attention=False))
        assert str(refused.value) == (
            "use_flash_attention=False runs this model's engine steps with the mask the default path reads, and the "
            "continuous batching manager kept on this model is running an engine built otherwise: stop it "
            "(manager.stop()) before asking for other flags, or pass the flags it runs with."
        )
        assert ours._continuous_batching_flags["use_flash_attention"]  # its running engine's flags, untouched
        assert ours.init_continuous_batching(generation_config=greedy_config(use_flash_attention=True)) is manager
    finally:
        ours.destroy_cached_continuous_batching_manager()


def test_a_request_without_max_new_tokens_ends_at_the_models_context():
    """transformers' engine reads an unset max_new_tokens as no limit: it ran past the context until its cache ran
    out, then failed the request with a scheduling error. Here such a request stops at the context, as a server's
    does, or is refused at once where the cache could not hold it that far."""
    ours, _ = models("llama", max_position_embeddings=40)
    requests = [prompts()[0], prompts()[3]]  # 5 and 12 tokens: 35 and 28 new tokens to the context
    unset = greedy_config(max_new_tokens=None, use_flash_attention=True)
    outputs = ours.generate_batch(inputs=requests, generation_config=unset, continuous_batching_config=small_engine())
    assert [output.status for output in outputs.values()] == [RequestStatus.FINISHED] * 2
    expected = [
        ours.generate(torch.tensor([ids]), generation_config=greedy_config(max_new_tokens=40 - len(ids)))[
            0, len(ids) :
        ]
        for ids in requests
    ]
    assert by_request(outputs) == [tokens.tolist() for tokens in expected]
    two_blocks = ContinuousBatchingConfig(page_size=16, num_blocks=2, max_batch_tokens=16)
    (refused,) = ours.generate_batch(
        inputs=requests[:1], generation_config=unset, continuous_batching_config=two_blocks
    ).values()
    assert refused.status == RequestStatus.FAILED and not refused.generated_tokens
    assert refused.error == (
        "max_new_tokens is not set, so this request may run to the end of the model's context (35 new tokens): the "
        "paged cache is too small for this request: its 5 prompt tokens and max_new_tokens 35 need 3 blocks of 16 "
        "tokens, the cache holds 2. Size it with ContinuousBatchingConfig(num_blocks=...) (serve: --cb-num-blocks) "
        "of at least 3, or lower max_new_tokens."
    )
