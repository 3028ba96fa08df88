"""The cache a Gaudi model's generate() builds instead of transformers' DynamicCache: appended in place, grown in
amortised steps, attended over its filled slots; the same tokens as stock on every route that uses it."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from optimum.habana import GaudiLlamaForCausalLM
from optimum.habana.kernels import dispatch
from optimum.habana.transformers import growing_cache
from optimum.habana.transformers.growing_cache import GrowingCache, GrowingLayer, grown_capacity
from tests.helpers import CopiedElements, build_pair, left_padded_batch, tiny_llama_config


GREEDY = {"do_sample": False, "pad_token_id": 0}
BLOCK = 4  # a small growth block, so that short generations grow the storage several times


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(growing_cache, "GROWTH_BLOCK", BLOCK)


@pytest.fixture(scope="module")
def pair() -> tuple[GaudiLlamaForCausalLM, LlamaForCausalLM]:
    return build_pair("llama")


def storage_pointer(cache: GrowingCache) -> int:
    return cache.layers[0].key_storage.data_ptr()


def test_capacity_is_one_growth_step_above_the_tokens_and_within_the_known_maximum():
    assert grown_capacity(100) == 256  # one block
    assert grown_capacity(8192) == 9216  # an eighth more, in whole blocks
    assert grown_capacity(8192, max_length=8200) == 8200  # generate() knows it never needs more
    assert grown_capacity(300, max_length=200) == 512  # a maximum below the need is no limit


@pytest.mark.parametrize("use_flash_attention", [True, False], ids=["flag", "default path"])
def test_generate_allocates_once_at_the_prompt_and_matches_stock(pair, use_flash_attention):
    ours, stock = pair
    inputs = left_padded_batch([9, 4, 7], seed=1)
    settings = {**GREEDY, "max_new_tokens": 20, "min_new_tokens": 20, "return_dict_in_generate": True}
    reference = stock.generate(**inputs, **settings)
    output = ours.generate(**inputs, use_flash_attention=use_flash_attention, **settings)
    assert torch.equal(output.sequences, reference.sequences)
    cache = output.past_key_values
    assert isinstance(cache, GrowingCache) and isinstance(cache, DynamicCache)
    # Sized at the prompt for all it will hold (prompt + new tokens - 1), and never grown: no copy.
    assert cache.layers[0].key_storage.shape[2] == cache.get_seq_length() == 9 + 20 - 1
    for layer, stock_layer in zip(cache.layers, reference.past_key_values.layers, strict=True):
        # The unpadded row (padding positions' states differ between attention paths, by design).
        torch.testing.assert_close(layer.keys[0], stock_layer.keys[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.values[0], stock_layer.values[0], rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("small_blocks")
def test_storage_is_written_in_place_and_moves_only_when_it_grows(pair):
    ours, stock = pair
    inputs = left_padded_batch([9, 6], seed=2)
    settings = {**GREEDY, "max_new_tokens": 40, "min_new_tokens": 40}
    cache = GrowingCache(ours.config)  # no known maximum: it grows by 1/8 of its length, in blocks of BLOCK tokens
    pointers = []
    hook = ours.register_forward_hook(lambda *args: pointers.append((storage_pointer(cache), cache.get_seq_length())))
    try:
        tokens = ours.generate(**inputs, past_key_values=cache, use_flash_attention=True, **settings)
    finally:
        hook.remove()
    assert torch.equal(tokens, stock.generate(**inputs, **settings))
    moves = [index for index in range(1, len(pointers)) if pointers[index][0] != pointers[index - 1][0]]
    capacities = [grown_capacity(9)]
    while capacities[-1] < 9 + 40 - 1:
        capacities.append(grown_capacity(capacities[-1] + 1))
    # The storage moved exactly when the tokens outgrew it, and stayed put for every other step.
    assert [pointers[index][1] for index in moves] == [capacity + 1 for capacity in capacities[:-1]]
    assert len(moves) < 40 // 4


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize(
    "route",
    ["beam search", "assisted decoding", "prompt lookup"],
)
def test_routes_that_reorder_or_crop_the_cache_match_stock_across_growth(pair, route):
    ours, stock = pair
    settings = {**GREEDY, "max_new_tokens": 24, "min_new_tokens": 24}
    if route == "beam search":
        inputs = left_padded_batch([9, 5], seed=3)
        settings.update(num_beams=3, num_return_sequences=2)
    else:
        inputs = left_padded_batch([7], seed=3)
        inputs = {name: tensor.repeat(1, 2) for name, tensor in inputs.items()}
        if route == "assisted decoding":
            torch.manual_seed(1)
            settings["assistant_model"] = GaudiLlamaForCausalLM(tiny_llama_config(num_hidden_layers=1)).eval()
        else:
            settings["prompt_lookup_num_tokens"] = 3
    reference = stock.generate(**inputs, **settings)
    for use_flash_attention in (True, False):
        cache = GrowingCache(ours.config)
        tokens = ours.generate(**inputs, past_key_values=cache, use_flash_attention=use_flash_attention, **settings)
        assert torch.equal(tokens, reference)
        assert cache.layers[0].key_storage.shape[2] > grown_capacity(inputs["input_ids"].shape[1])  # it grew


@pytest.mark.parametrize("use_flash_attention", [True, False], ids=["flag", "default path"])
def test_a_decode_step_copies_nothing_that_grows_with_the_context(pair, use_flash_attention):
    """Stock's DynamicCache copies the whole cache per token (torch.cat): the same count, by operator, grows with
    the context there; here it is the same at two contexts. The default path's grouped-query products copy nothing
    either (a broadcast product would copy the keys once per group)."""
    ours, stock = pair

    def copies(model, cache_class, context: int, **kwargs) -> Counter:
        inputs = left_padded_batch([context], seed=4)
        cache = cache_class(config=model.config)
        with torch.no_grad():
            model(**inputs, past_key_values=cache, use_cache=True, **kwargs)
            with CopiedElements() as counter:
                model(input_ids=inputs["input_ids"][:, -1:], past_key_values=cache, use_cache=True, **kwargs)
        return counter.counts

    short, long = (
        copies(ours, GrowingCache, context, use_flash_attention=use_flash_attention) for context in (40, 80)
    )
    assert short == long
    stock_short, stock_long = (copies(stock, DynamicCache, context) for context in (40, 80))
    assert stock_long["aten::cat"] > stock_short["aten::cat"]


def test_the_fused_kernel_reads_the_filled_slots_of_the_storage_itself(pair, monkeypatch):
    """Each decode step's kernel call (PyTorch's, or the CPU decode kernel) gets views of the cache's storage (no
    copy), each key/value head once for its whole query group (the group's two queries are its rows: no repeat, no
    broadcast) and the filled slots only."""
    ours, _ = pair
    seen = []

    def spy_on(kernel):
        def spy(query, key, value, *args, **kwargs):
            seen.append((query.shape, key, value, kwargs.get("enable_gqa")))
            return kernel(query, key, value, *args, **kwargs)

        return spy

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy_on(F.scaled_dot_product_attention))
    monkeypatch.setattr(dispatch, "cpu_decode_sdpa", spy_on(dispatch.cpu_decode_sdpa))
    cache = GrowingCache(ours.config, max_cache_len=64)
    inputs = left_padded_batch([9, 9], seed=5)
    ours.generate(
        **inputs, past_key_values=cache, use_flash_attention=True, max_new_tokens=4, min_new_tokens=4, **GREEDY
    )
    decode = seen[2:]  # after the prompt's two layers
    assert len(decode) == 2 * 3
    storages = {layer.key_storage.data_ptr() for layer in cache.layers}
    storages |= {layer.value_storage.data_ptr() for layer in cache.layers}
    for step, (query_shape, key, value, enable_gqa) in enumerate(decode):
        assert key.data_ptr() in storages and value.data_ptr() in storages
        assert query_shape == (2, 2, 2, 16) and key.shape[1] == value.shape[1] == 2 and not enable_gqa
        assert key.shape[2] == 9 + 1 + step // 2


def test_layer_operations_match_transformers_dynamic_layer():
    """What generate() and users do to a dynamic layer, on both: the same keys and values after each operation."""
    torch.manual_seed(0)
    ours, stock, batch = GrowingLayer(), DynamicLayer(), 3
    operations = [
        ("update", 5),
        ("update", 1),
        ("crop", -2),
        ("update", 3),
        ("reorder_cache", torch.tensor([1, 0, 0])),
        ("update", 300),
        ("batch_select_indices", torch.tensor([0, 2])),
        ("batch_repeat_interleave", 2),
        ("update", 1),
    ]
    for name, argument in operations:
        if name == "update":
            keys = torch.randn(batch, 2, argument, 8)
            for mine, theirs in zip(ours.update(keys, keys * 2), stock.update(keys, keys * 2), strict=True):
                assert torch.equal(mine, theirs)
        else:
            getattr(ours, name)(argument)
            getattr(stock, name)(argument)
            batch = stock.keys.shape[0]
        assert torch.equal(ours.keys, stock.keys) and torch.equal(ours.values, stock.values)
        assert ours.get_seq_length() == stock.get_seq_length()
    ours.reset()
    assert ours.get_seq_length() == 0 and ours.keys is None
