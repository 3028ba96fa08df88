"""The continuous batching engine of a Gaudi model (`optimum.habana.transformers.continuous_batching`): seeded
sampling repeats, a request the engine cannot serve fails alone with its reason and the numbers, and `stop()`
interrupts the requests still running on Ctrl-C or when its timeout runs out.

(Library behaviour; kept here, next to run_generation.py's --continuous_batching tests, while tests/core is
another engineer's.)
"""

import time

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.requests import RequestStatus

from optimum.habana.transformers.continuous_batching import INTERRUPTED
from optimum.habana.transformers.continuous_batching.capacity import cache_geometry, cached_tokens
from tests.families.support import family_pair
from tests.helpers import build_pair, tiny_config


@pytest.fixture(scope="module")
def model():
    return build_pair("llama")[0]


def engine(**overrides) -> ContinuousBatchingConfig:
    """A paged cache sized for these requests: sized from free memory by default, it takes seconds to allocate."""
    return ContinuousBatchingConfig(**{"page_size": 16, "num_blocks": 32, "max_batch_tokens": 64, **overrides})


def prompts(lengths=(5, 9, 3, 12)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (length,), generator=generator).tolist() for length in lengths]


def config(**overrides) -> GenerationConfig:
    values = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": -1, "pad_token_id": 0}
    return GenerationConfig(**{**values, **overrides})


def by_request(outputs: dict) -> list:
    return sorted(outputs.values(), key=lambda output: int(output.request_id.rsplit("_", 1)[-1]))


def sampled(model, generation_config, continuous_batching_config) -> list[list[int]]:
    torch.randn(7)  # the global generator moves on between runs, as it does in a real program
    outputs = model.generate_batch(
        inputs=prompts(), generation_config=generation_config, continuous_batching_config=continuous_batching_config
    )
    return [output.generated_tokens for output in by_request(outputs)]


@pytest.mark.parametrize("where", ["engine config", "generation config"])
def test_a_seed_makes_sampled_tokens_repeat(where, model):
    def run(seed):
        if where == "engine config":
            return sampled(model, config(do_sample=True), engine(seed=seed))
        return sampled(model, config(do_sample=True, seed=seed), engine())

    first = run(3)
    assert run(3) == first
    assert run(4) != first  # the seed is what decides the samples


def test_the_whole_batch_enters_the_engine_at_once(model, monkeypatch):
    """`add_requests` queues while the loop is paused: however slowly requests are added, the loop never starts
    on part of the batch, so the steps it schedules (and the samples they draw) are the same on every run."""
    arrivals = []
    with model.continuous_batching_context_manager(
        generation_config=config(max_new_tokens=20), continuous_batching_config=engine()
    ) as manager:
        scheduler = manager.batch_processor.scheduler
        add_waiting_request = scheduler.add_waiting_request

        def record(state):
            arrivals.append(manager.current_batch)
            return add_waiting_request(state)

        monkeypatch.setattr(scheduler, "add_waiting_request", record)
        add_request = manager.add_request

        def slow_add_request(*args, **kwargs):
            time.sleep(0.05)  # a slow caller: without the pause the loop would start on the first requests
            return add_request(*args, **kwargs)

        monkeypatch.setattr(manager, "add_request", slow_add_request)
        ids = manager.add_requests(prompts())
        results = [manager.get_result(timeout=30) for _ in ids]
    assert all(result.status == RequestStatus.FINISHED for result in results)
    assert len(arrivals) == 4 and len(set(arrivals)) == 1


def test_an_out_of_vocabulary_token_fails_its_request_alone(model):
    requests = prompts()
    requests[1] = [5, 100_000, 7]
    requests.append([-1, 4])
    outputs = by_request(
        model.generate_batch(inputs=requests, generation_config=config(), continuous_batching_config=engine())
    )
    assert [output.status for output in outputs] == [RequestStatus.FINISHED, RequestStatus.FAILED] + [
        RequestStatus.FINISHED
    ] * 2 + [RequestStatus.FAILED]
    assert outputs[1].error == (
        "token id 100000 is outside the model's vocabulary (0 to 255): tokenize with the model's tokenizer."
    )
    assert "token id -1 is outside" in outputs[4].error
    assert all(len(outputs[index].generated_tokens) == 6 for index in (0, 2, 3))


def test_a_prompt_and_new_tokens_past_the_context_fail_alone(model):
    context = model.config.max_position_embeddings
    requests = [prompts()[0], [3 + index % 250 for index in range(context - 2)]]
    outputs = by_request(
        model.generate_batch(
            inputs=requests, generation_config=config(), continuous_batching_config=engine(num_blocks=160)
        )
    )
    assert outputs[0].status == RequestStatus.FINISHED and len(outputs[0].generated_tokens) == 6
    assert outputs[1].status == RequestStatus.FAILED
    assert outputs[1].error == (
        f"the prompt's {context - 2} tokens and max_new_tokens 6 pass the model's context of {context} positions "
        "(max_position_embeddings): lower max_new_tokens to at most 2 or shorten the prompt."
    )


def test_a_cache_too_small_for_a_request_says_so_with_the_numbers_and_how_to_size_it(model):
    requests = [prompts()[0], [3 + index % 250 for index in range(197)], prompts()[2]]
    outputs = by_request(
        model.generate_batch(
            inputs=requests, generation_config=config(), continuous_batching_config=engine(num_blocks=4)
        )
    )
    assert [output.status for output in outputs] == [
        RequestStatus.FINISHED,
        RequestStatus.FAILED,
        RequestStatus.FINISHED,
    ]
    assert outputs[1].error == (
        "the paged cache is too small for this request: its 197 prompt tokens and max_new_tokens 6 need 13 blocks "
        "of 16 tokens, the cache holds 4. Size it with ContinuousBatchingConfig(num_blocks=...) (serve: "
        "--cb-num-blocks) of at least 13, or lower max_new_tokens."
    )


def test_sliding_window_layers_need_only_their_window():
    full = cache_geometry(tiny_config("llama"), page_size=16)
    assert full.blocks_for(full.sectors_for(cached_tokens(197, 6))) == 13  # 202 tokens
    windowed = cache_geometry(tiny_config("mistral", sliding_window=32), page_size=16)  # every layer keeps 32 tokens
    assert windowed.blocks_for(windowed.sectors_for(cached_tokens(197, 6))) == 2
    for geometry in (full, windowed):
        for sectors in range(1, 9):  # the fewest blocks that give the sectors, and no fewer
            least = geometry.blocks_for(sectors)
            assert geometry.sectors_of(least) >= sectors and (least == 1 or geometry.sectors_of(least - 1) < sectors)


@pytest.mark.parametrize("max_new_tokens", [11, 12])
def test_a_request_the_engine_serves_alone_is_admitted(max_new_tokens):
    """A full-attention group uses room the sliding layer leaves free, and the last new token takes no slot: what
    stock's engine serves is admitted (the blocks averaged over the layers refused it), what it cannot is refused."""
    layer_types = ["sliding_attention", "full_attention", "full_attention", "full_attention"]
    ours, stock = family_pair("gemma3_text", layer_types=layer_types, sliding_window=8, num_hidden_layers=4)
    prompt = prompts((10,))
    settings = {"generation_config": config(max_new_tokens=max_new_tokens)}
    settings["continuous_batching_config"] = engine(num_blocks=4, page_size=4, max_batch_tokens=16)
    (expected,) = stock.generate_batch(inputs=prompt, **settings).values()
    (output,) = ours.generate_batch(inputs=prompt, **settings, use_flash_attention=True).values()
    assert (
        output.status == expected.status == (RequestStatus.FINISHED if max_new_tokens == 11 else RequestStatus.FAILED)
    )
    if output.status == RequestStatus.FINISHED:
        assert output.generated_tokens == expected.generated_tokens
    else:
        assert output.error.startswith("the paged cache is too small for this request")


def long_config() -> GenerationConfig:
    return config(max_new_tokens=1500)


def test_stop_with_a_timeout_interrupts_the_running_requests(model):
    manager = model.init_continuous_batching(
        generation_config=long_config(), continuous_batching_config=engine(num_blocks=300)
    )
    manager.start()
    request_id = manager.add_request(prompts()[0], streaming=True)
    first = next(manager.request_id_iter(request_id))  # the request is running
    assert not first.is_finished()
    manager.stop(block=True, timeout=0)
    assert not manager.is_running()
    results = []
    while (result := manager.get_result(timeout=0.1)) is not None:
        results.append(result)
    final = [result for result in results if result.is_finished()]
    assert len(final) == 1 and final[0].status == RequestStatus.FAILED
    assert final[0].error == INTERRUPTED
    assert 0 < len(final[0].generated_tokens) < 1500


def test_ctrl_c_interrupts_the_running_requests_instead_of_finishing_them(model):
    with (
        pytest.raises(KeyboardInterrupt),
        model.continuous_batching_context_manager(
            generation_config=long_config(), continuous_batching_config=engine(num_blocks=300)
        ) as manager,
    ):
        request_id = manager.add_request(prompts()[0], streaming=True)
        next(manager.request_id_iter(request_id))
        raise KeyboardInterrupt  # what Ctrl-C raises in the thread that waits for results
    results = []
    while (result := manager.get_result(timeout=0.1)) is not None:
        results.append(result)
    final = [result for result in results if result.is_finished()]
    assert final and final[-1].status == RequestStatus.FAILED and final[-1].error == INTERRUPTED
    assert len(final[-1].generated_tokens) < 1500
