"""A CPU decode step of one sequence, its context cut into pieces so that every thread reads a share of the cache:
the same attention as the whole kernel (masks, pieces masked whole, a tail that does not divide), views of the
cache and no copy, and the same greedy tokens as stock. The cut runs where the CPU decode kernel does not (bfloat16,
float16, or no kernel built): these tests turn the kernel off."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from optimum.habana.kernels import cpu_decode, split_context
from optimum.habana.kernels.split_context import context_splits, split_context_sdpa
from tests.helpers import build_pair, count_context_cuts, decode_step_copies


GREEDY = {"do_sample": False, "pad_token_id": 0}


@pytest.fixture(autouse=True)
def without_decode_kernel(monkeypatch):
    monkeypatch.setenv(cpu_decode.ENV_VAR, "0")


@pytest.fixture
def short_pieces(monkeypatch):
    monkeypatch.setattr(split_context, "MIN_PIECE_TOKENS", 4)


def decode_inputs(kv_heads: int, groups: int, length: int, dtype=torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, kv_heads, groups, 64, generator=generator).to(dtype)
    # Views of a longer storage, as a cache's filled slots are.
    key, value = (torch.randn(1, kv_heads, length + 7, 64, generator=generator).to(dtype)[:, :, :length] for _ in "kv")
    return query, key, value


def masks(length: int) -> dict[str, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(1)
    random_keys = torch.rand(1, 1, 1, length, generator=generator) > 0.3
    first_half_padding = torch.ones(1, 1, 1, length, dtype=torch.bool)
    first_half_padding[..., : length // 2 + 3] = False  # whole pieces masked, one piece in part
    per_row = torch.where(torch.rand(1, 3, 2, length, generator=generator) > 0.3, 0.0, -torch.inf)
    return {
        "none": None,
        "bool": random_keys,
        "bool, pieces masked whole": first_half_padding,
        "additive -inf, per head and row": per_row,
        "additive finfo.min": torch.where(random_keys, 0.0, torch.finfo(torch.float32).min),
    }


@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("length", [4096, 1001])  # 1001 leaves a tail for every split count
@pytest.mark.parametrize("mask_name", list(masks(8)))
def test_pieces_combine_to_the_whole_kernel(splits, length, mask_name):
    query, key, value = decode_inputs(kv_heads=3, groups=2, length=length)
    mask = masks(length)[mask_name]
    expected = F.scaled_dot_product_attention(query, key, value, mask, scale=0.125)
    output = split_context_sdpa(query, key, value, mask, scale=0.125, splits=splits)
    assert output.shape == expected.shape and output.dtype == expected.dtype
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


def test_a_row_that_may_attend_to_nothing_is_zero_as_in_the_whole_kernel():
    query, key, value = decode_inputs(kv_heads=3, groups=2, length=3000)
    mask = torch.zeros(1, 1, 1, 3000, dtype=torch.bool)
    assert F.scaled_dot_product_attention(query, key, value, mask).abs().max() == 0
    assert split_context_sdpa(query, key, value, mask, scale=0.125, splits=2).abs().max() == 0


@pytest.mark.parametrize(
    "mask_dtype", [None, torch.bool, torch.float32], ids=["no mask", "boolean", "float32 additive"]
)
def test_bfloat16_stays_within_one_rounding_of_the_whole_kernel(mask_dtype):
    query, key, value = decode_inputs(kv_heads=1, groups=8, length=4099, dtype=torch.bfloat16)
    mask = None if mask_dtype is None else masks(4099)["bool"]
    if mask_dtype == torch.float32:
        mask = torch.where(mask, 0.0, -torch.inf)
    expected = F.scaled_dot_product_attention(query, key, value, mask, scale=0.125)
    output = split_context_sdpa(query, key, value, mask, scale=0.125, splits=2)
    assert output.dtype == torch.bfloat16
    torch.testing.assert_close(output, expected, rtol=1.6e-2, atol=2e-3)


@pytest.mark.parametrize(
    ("kv_heads", "thread_count", "length", "expected"),
    [
        (1, 2, 8192, 2),  # one key/value head: one thread would do everything
        (8, 16, 16384, 2),  # Llama-3-8B on 16 threads: half of them idle
        (3, 8, 8192, 8),  # 24 pieces fill 8 threads; 2 to 7 splits leave some idle
        (3, 8, 4096, 2),  # at most 4 pieces of MIN_PIECE_TOKENS: 6 or 12 pieces on 8 threads, the fewer wins
        (3, 2, 8192, 1),  # SmolLM2 on 2 threads uses 3/4 of their time: the cut costs more than it gains
        (4, 2, 8192, 1),  # the heads share out evenly already
        (1, 1, 8192, 1),  # one thread
        (1, 2, 2047, 1),  # pieces would be shorter than MIN_PIECE_TOKENS
    ],
)
def test_the_context_is_cut_when_threads_would_idle(threads, kv_heads, thread_count, length, expected):
    threads(thread_count)
    query, key, value = decode_inputs(kv_heads, groups=3, length=length)
    assert context_splits(query, key, value, None, is_causal=False, dropout_p=0.0) == expected


@pytest.mark.parametrize(
    "case",
    [
        "two sequences",
        "causal",
        "dropout",
        "gradients",
        "a prompt's rows",
        "heads not stacked",
        "value heads of another size",
        "mask of 2",
    ],
)
def test_other_calls_go_to_the_kernel_whole(threads, case):
    threads(2)
    query, key, value = decode_inputs(kv_heads=1, groups=4, length=8192)
    mask, options = None, {"is_causal": False, "dropout_p": 0.0}
    if case == "two sequences":
        query, key = query.expand(2, -1, -1, -1), key.expand(2, -1, -1, -1)
    elif case == "causal":
        options["is_causal"] = True
    elif case == "dropout":
        options["dropout_p"] = 0.1
    elif case == "gradients":
        query.requires_grad_()
    elif case == "a prompt's rows":
        query = query.repeat(1, 1, 16, 1)
    elif case == "heads not stacked":
        query = query.reshape(1, 4, 1, 64)
    elif case == "value heads of another size":  # latent attention
        value = value[..., :32]
    elif case == "mask of 2":
        mask = torch.ones(2, 1, 1, 8192, dtype=torch.bool)
    assert context_splits(query, key, value, mask, **options) == 1


@pytest.fixture(scope="module")
def pair():
    return build_pair("llama")


def prompt_with_padding(length: int, padding: int) -> dict[str, torch.Tensor]:
    """One sequence, optionally with left padding: the decode step's mask then masks the first pieces whole."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 256, (1, length), generator=generator)
    attention_mask = torch.ones(1, length, dtype=torch.long)
    input_ids[:, :padding], attention_mask[:, :padding] = 0, 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.mark.parametrize("padding", [0, 14], ids=["no padding", "left padding"])
def test_generate_cuts_each_decode_step_and_gives_stock_tokens(pair, threads, short_pieces, monkeypatch, padding):
    """Two key/value heads on four threads: two pieces per call, a tail whenever the context is odd."""
    threads(4)
    ours, stock = pair
    cuts = count_context_cuts(monkeypatch)
    inputs = prompt_with_padding(20, padding)
    settings = {"max_new_tokens": 10, "min_new_tokens": 10, **GREEDY}
    tokens = ours.generate(**inputs, use_flash_attention=True, **settings)
    assert cuts == {2: 9 * 2}  # every decode step of both layers; the prompt is causal and goes whole
    assert torch.equal(tokens, stock.generate(**inputs, **settings))


def test_the_pieces_are_views_of_the_cache_and_a_step_copies_nothing_that_grows(pair, threads, short_pieces):
    threads(4)
    ours, _ = pair
    seen_storages = []
    attend = split_context._attend

    def spy(query, key, value, *args):
        seen_storages.append(key.untyped_storage().data_ptr())
        return attend(query, key, value, *args)

    def step(context: int) -> tuple[Counter, set, set]:
        prompt = prompt_with_padding(context, padding=0)
        seen_storages.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(split_context, "_attend", spy)
            copies, storages = decode_step_copies(ours, prompt, {"input_ids": prompt["input_ids"][:, -1:]})
        return copies, set(seen_storages), storages

    short, short_seen, short_storages = step(40)
    long, long_seen, long_storages = step(80)  # 41 and 81 tokens: two pieces and a tail of one each time
    assert short_seen == short_storages and long_seen == long_storages  # the kernel read the cache itself
    assert short == long
