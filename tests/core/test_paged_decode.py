"""Continuous batching reads its paged cache in place (`transformers/paged_attention.py`): the decode kernel's paged
entry gives PyTorch's attention over the gathered keys, a slot outside the cache is an error and no read, and with
the flag transformers' engine never gathers a sequence's cache, its decode rows run on the kernel, and every request
gets its own generate()'s greedy tokens."""

import pytest
import torch
import torch.nn.functional as F
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

from optimum.habana.kernels import cpu_decode
from optimum.habana.kernels.cpu_decode import paged_decode_applies, paged_decode_sdpa
from optimum.habana.transformers import attention, paged_attention
from tests.core.test_continuous_batching import NEW_TOKENS, by_request, greedy_config
from tests.helpers import SLIDING_WINDOW_CONFIGS, build_pair, count_attention_paths, query_sizes


needs_kernel = pytest.mark.skipif(
    cpu_decode.environment_problem() is not None, reason=f"no decode kernel here: {cpu_decode.environment_problem()}"
)


def paged_inputs(heads: int, kv_heads: int, head_dim: int, lengths: list[int], dtype=torch.float32, seed: int = 0):
    """A paged cache's key and value views (offset views of one storage, as the engine's allocator makes them),
    each sequence's tokens at scattered slots, and one query row per sequence."""
    generator = torch.Generator().manual_seed(seed)
    slots_held = sum(lengths) + 300
    storage = torch.randn(2 * slots_held, kv_heads, head_dim, generator=generator).to(dtype)
    keys, values = storage[:slots_held], storage[slots_held - 50 :][:slots_held]
    order = torch.randperm(slots_held, generator=generator)
    starts = [sum(lengths[:index]) for index in range(len(lengths))]
    slots = order[: sum(lengths)]
    query = torch.randn(len(lengths), heads, head_dim, generator=generator).to(dtype)
    return query, keys, values, slots, starts


def gathered_attention(query, keys, values, slots, starts, lengths, sinks=None):
    """Each sequence's row over its gathered keys, by PyTorch's attention (zeros for a sequence without keys);
    `sinks` (one per head) as one more key whose score is the sink and whose value is zero."""
    rows = []
    for row, start, length in zip(query, starts, lengths, strict=True):
        if length == 0:
            rows.append(torch.zeros_like(row, dtype=torch.float32))
            continue
        index = slots[start : start + length]
        key, value = (pages.index_select(0, index).transpose(0, 1)[None].float() for pages in (keys, values))
        if sinks is not None:
            row_query = row.float() * row.shape[-1] ** -0.5
            scores = row_query[:, None] @ key[0].repeat_interleave(row.shape[0] // key.shape[1], 0).transpose(1, 2)
            scores = torch.cat([scores[:, 0], sinks[:, None].float()], dim=-1)
            weights = torch.softmax(scores, dim=-1)[:, :-1]
            repeated = value[0].repeat_interleave(row.shape[0] // key.shape[1], 0)
            rows.append((weights[:, None] @ repeated)[:, 0])
            continue
        rows.append(F.scaled_dot_product_attention(row[None, :, None].float(), key, value, enable_gqa=True)[0, :, 0])
    return torch.stack(rows)


PAGED_SHAPES = {
    "SmolLM2's groups of 3, one long sequence beside short ones": (9, 3, 64, [5000, 17, 1]),
    "one sequence, groups of 4, heads of 128": (8, 2, 128, [3000]),
    "no groups, heads of 80, an empty sequence": (4, 4, 80, [300, 0, 700, 1025]),
    "groups of 5, heads of 44 (the kernel's blocks' remainders)": (10, 2, 44, [1037, 3]),
}


@needs_kernel
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", list(PAGED_SHAPES))
def test_the_paged_entry_gives_pytorchs_attention_over_the_gathered_keys(shape, dtype, with_sinks):
    heads, kv_heads, head_dim, lengths = PAGED_SHAPES[shape]
    query, keys, values, slots, starts = paged_inputs(heads, kv_heads, head_dim, lengths, dtype)
    sinks = torch.linspace(-2.0, 6.0, heads) if with_sinks else None  # up to far above the scores: they count
    assert paged_decode_applies(query[None].transpose(1, 2), keys, sinks)
    output = paged_decode_sdpa(query, keys, values, slots, starts, lengths, scale=head_dim**-0.5, sinks=sinks)
    expected = gathered_attention(query, keys, values, slots, starts, lengths, sinks)
    assert output.dtype == dtype
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(output.float(), expected.to(dtype).float(), **tolerance)


@needs_kernel
@pytest.mark.parametrize("thread_count", [1, 2, 3])
def test_any_thread_count_gives_the_same_paged_attention(threads, thread_count):
    query, keys, values, slots, starts = paged_inputs(9, 3, 64, [4099, 600, 2])
    threads(thread_count)
    output = paged_decode_sdpa(query, keys, values, slots, starts, [4099, 600, 2], scale=0.125)
    expected = gathered_attention(query, keys, values, slots, starts, [4099, 600, 2]) if thread_count == 1 else None
    threads(1)
    reference = paged_decode_sdpa(query, keys, values, slots, starts, [4099, 600, 2], scale=0.125)
    torch.testing.assert_close(output, reference, rtol=1e-6, atol=1e-7)
    if expected is not None:
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_a_slot_outside_the_cache_is_an_error_not_a_read():
    query, keys, values, slots, starts = paged_inputs(9, 3, 64, [100, 20])
    slots = slots.clone()
    slots[110] = keys.shape[0] + 5
    with pytest.raises(ValueError, match=r"lies outside the \d+ it holds"):
        paged_decode_sdpa(query, keys, values, slots, starts, [100, 20], scale=0.125)
    with pytest.raises(ValueError, match="run past the 120 slots"):
        paged_decode_sdpa(query, keys, values, slots, starts, [100, 21], scale=0.125)


@pytest.mark.parametrize(
    "case",
    ["float16", "a gradient", "a query group of 40", "heads of another size", "the kernel off"],
)
def test_the_paged_calls_it_leaves_to_the_engines_gather(case, monkeypatch):
    query, keys = torch.randn(1, 6, 1, 64), torch.randn(500, 3, 64)
    if case == "float16":
        query, keys = query.half(), keys.half()
    elif case == "a gradient":
        query.requires_grad_()
    elif case == "a query group of 40":
        query = torch.randn(1, 120, 1, 64)
    elif case == "heads of another size":
        keys = torch.randn(500, 3, 32)
    else:
        monkeypatch.setenv(cpu_decode.ENV_VAR, "0")
    assert not paged_decode_applies(query, keys)


def engine(max_batch_tokens: int = 64) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(page_size=16, num_blocks=48, max_batch_tokens=max_batch_tokens)


def engine_reads(monkeypatch) -> list[int]:
    """The tokens each call of the engine's cache update gathered back (`index_select`): 0 where it only wrote."""
    reads: list[int] = []
    update = FullAttentionCacheAllocator.update

    def counted(self, key_states, value_states, layer_idx, read_index, write_index):
        reads.append(read_index.numel())
        return update(self, key_states, value_states, layer_idx, read_index, write_index)

    monkeypatch.setattr(FullAttentionCacheAllocator, "update", counted)
    return reads


def paged_rows(monkeypatch) -> list[int]:
    """The sequences each call of the paged kernel attended for."""
    return query_sizes(monkeypatch, paged_attention, "paged_decode_sdpa", 0)


@needs_kernel
@pytest.mark.parametrize(
    ("prompt_lengths", "max_batch_tokens"),
    [((5, 9, 3, 12), 64), ((40, 3, 20), 16)],
    ids=["prompts in one step, then decode steps", "prompts in chunks next to decoding requests"],
)
def test_the_flag_reads_the_paged_cache_in_place_and_gives_generates_tokens(
    prompt_lengths, max_batch_tokens, monkeypatch
):
    ours, stock = build_pair("llama")
    stock.set_attn_implementation("sdpa")
    generator = torch.Generator().manual_seed(0)
    requests = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in prompt_lengths]
    expected = [
        ours.generate(torch.tensor([ids]), generation_config=greedy_config())[0, len(ids) :].tolist()
        for ids in requests
    ]
    stock_outputs = stock.generate_batch(
        requests, generation_config=greedy_config(), continuous_batching_config=engine()
    )
    assert by_request(stock_outputs) == expected
    for flag in (True, False):
        with monkeypatch.context() as patch:
            reads, rows = engine_reads(patch), paged_rows(patch)
            outputs = ours.generate_batch(
                requests,
                generation_config=greedy_config(use_flash_attention=flag),
                continuous_batching_config=engine(max_batch_tokens),
            )
        assert by_request(outputs) == expected, f"use_flash_attention={flag}"
        layers = ours.config.num_hidden_layers
        if flag:  # every layer of every step wrote only; each step with decoding requests ran the kernel once
            assert reads and set(reads) == {0}
            assert len(rows) % layers == 0 and len(rows) // layers >= NEW_TOKENS - 1
            assert max(rows) == len(requests)  # the requests decoding together, in one call
        else:  # the default path reads what the engine gathers (the spy can see a gather)
            assert max(reads) > 0 and not rows


@needs_kernel
@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text"])
def test_full_attention_layers_beside_sliding_windows_read_in_place(model_type, monkeypatch):
    """An alternating model: the engine builds its masks (the windows need them), the sliding-window layers read them
    over the engine's gather (at most a window of tokens), the full-attention layers read their pages in place."""
    ours, _ = build_pair(model_type, **SLIDING_WINDOW_CONFIGS[model_type])
    generator = torch.Generator().manual_seed(1)
    requests = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (8, 3, 13)]
    expected = [
        ours.generate(torch.tensor([ids]), generation_config=greedy_config())[0, len(ids) :].tolist()
        for ids in requests
    ]
    full = group_layers_by_attn_type(ours.config)["full_attention"]
    in_place_layers = []
    attend = paged_attention.paged_step_in_place

    def spied(module, *args, **kwargs):
        output = attend(module, *args, **kwargs)
        if output is not None:
            in_place_layers.append(module.layer_idx)
        return output

    monkeypatch.setattr(attention, "paged_step_in_place", spied)
    outputs = ours.generate_batch(
        requests, generation_config=greedy_config(use_flash_attention=True), continuous_batching_config=engine(16)
    )
    assert by_request(outputs) == expected
    assert in_place_layers and set(in_place_layers) == set(full)


@needs_kernel
def test_without_the_kernel_the_engine_gathers_and_the_tokens_are_the_same(monkeypatch):
    ours, _ = build_pair("llama")
    requests = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    tokens = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_decode.ENV_VAR, switch)
        with monkeypatch.context() as patch:
            reads = engine_reads(patch)
            with count_attention_paths(patch, profile=False) as counts:
                outputs = ours.generate_batch(
                    requests,
                    generation_config=greedy_config(use_flash_attention=True),
                    continuous_batching_config=engine(),
                )
        tokens[switch] = by_request(outputs)
        assert counts["default"] == 0 and counts["fused"] > 0
        assert (max(reads) > 0) == (switch == "0")
    assert tokens["1"] == tokens["0"]


@needs_kernel
def test_bfloat16_continuous_batching_gives_generates_tokens_on_the_same_kernel(monkeypatch):
    """bf16 rounds differently on the decode kernel (float32 arithmetic, one rounding) than on PyTorch's: the paged
    cache read in place gives what generate() gives on the dense cache with the same kernel, token for token."""
    ours, _ = build_pair("llama")
    ours = ours.to(torch.bfloat16)
    requests = [[5, 6, 7, 8, 9], [9, 10, 11], list(range(20, 33))]
    config = greedy_config(use_flash_attention=True)
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_decode.ENV_VAR, switch)
        expected = [
            ours.generate(torch.tensor([ids]), generation_config=config)[0, len(ids) :].tolist() for ids in requests
        ]
        with monkeypatch.context() as patch:
            rows = paged_rows(patch)
            outputs = ours.generate_batch(requests, generation_config=config, continuous_batching_config=engine())
        assert by_request(outputs) == expected, f"{cpu_decode.ENV_VAR}={switch}"
        assert bool(rows) == (switch == "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("requests", "max_batch_tokens"),
    [
        ([[5]], 64),
        ([[5], [7, 8, 9]], 64),
        ([list(range(20, 60)), [5], [6]], 16),
    ],
    ids=["a one-token prompt alone", "beside a longer prompt in the first step", "in later steps, beside cached ones"],
)
def test_one_token_prompts_get_generates_tokens_with_and_without_the_flag(requests, max_batch_tokens, dtype):
    """A one-token prompt is one query row, as a decode row is; in a step where nothing is cached yet (the engine's
    read index is empty) it has no page to read, and the engine's own keys serve it. Every request gets its own
    generate()'s tokens, none is emptied and none carries an error."""
    ours, _ = build_pair("llama")
    ours = ours.to(dtype)
    for flag in (True, False):
        config = greedy_config(use_flash_attention=flag)
        expected = [
            ours.generate(torch.tensor([ids]), generation_config=config)[0, len(ids) :].tolist() for ids in requests
        ]
        outputs = ours.generate_batch(
            requests, generation_config=config, continuous_batching_config=engine(max_batch_tokens)
        )
        assert [output.error for output in outputs.values()] == [None] * len(requests), f"use_flash_attention={flag}"
        assert by_request(outputs) == expected, f"use_flash_attention={flag}"
        assert all(len(tokens) == NEW_TOKENS for tokens in expected)
