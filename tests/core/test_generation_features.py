"""Drop-in for generate(): every generation feature of the stock class works with the Gaudi class of every family.

Each feature runs on the stock class (eager attention, same weights) and on ours, with and without the flag: the
tokens must be the stock ones, and with the flag every attention call of our model must take the fused path.
"""

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from optimum.habana.transformers.cache import BucketedStaticCache
from tests.helpers import (
    FAMILIES,
    SLIDING_WINDOW_CONFIGS,
    SOFT_CAPPED,
    build_pair,
    count_attention_paths,
    left_padded_batch,
    tiny_llama_config,
    train_tiny_tokenizer,
)


NEW_TOKENS = 4
GREEDY = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}


class CollectingStreamer(BaseStreamer):
    """Keeps what generate() streams: the prompt first, then each new token."""

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.reshape(-1))

    def end(self) -> None:
        self.ended = True


def from_embeddings(model, inputs, **kwargs):
    """generate(inputs_embeds=...): the output holds the new tokens only, as with the stock class."""
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    return model.generate(inputs_embeds=embeds, attention_mask=inputs["attention_mask"], **GREEDY, **kwargs)


def beam_search(model, inputs, **kwargs):
    return model.generate(**inputs, num_beams=3, num_return_sequences=2, **GREEDY, **kwargs)


def dict_output(model, inputs, **kwargs):
    """The sequences, and the scores (equal within float error, not bitwise, across attention paths)."""
    output = model.generate(**inputs, return_dict_in_generate=True, output_scores=True, **GREEDY, **kwargs)
    return output.sequences, torch.stack(output.scores, dim=1)


def static_cache(model, inputs, **kwargs):
    return model.generate(**inputs, cache_implementation="static", **GREEDY, **kwargs)


def static_cache_next_turn(model, inputs, **kwargs):
    """A second generate() from the first one's static cache, with 3 more prompt tokens: past its max_cache_len."""
    first = model.generate(**inputs, cache_implementation="static", return_dict_in_generate=True, **GREEDY, **kwargs)
    turn = torch.cat([first.sequences, torch.full((first.sequences.shape[0], 3), 7)], dim=1)
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(turn[:, inputs["attention_mask"].shape[1] :])], dim=1)
    return model.generate(
        input_ids=turn, attention_mask=mask, past_key_values=first.past_key_values, **GREEDY, **kwargs
    )


def embeddings_into_bucketed_cache(model, inputs, **kwargs):
    """Our cache (--bucket_size): only our classes size its buckets, so the stock reference is `from_embeddings`."""
    cache = BucketedStaticCache(model.config, max_cache_len=24, bucket_size=4)
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    return model.generate(
        inputs_embeds=embeds, attention_mask=inputs["attention_mask"], past_key_values=cache, **GREEDY, **kwargs
    )


def streamed(model, inputs, **kwargs):
    """Batch 1 (streamers take one sequence): the streamed tokens, which must be the returned ones."""
    streamer = CollectingStreamer()
    output = model.generate(**inputs, streamer=streamer, **GREEDY, **kwargs)
    assert streamer.ended and torch.equal(torch.cat(streamer.chunks), output[0])
    return output


def stop_strings(model, inputs, **kwargs):
    """generate(tokenizer=..., stop_strings=...), as transformers serve calls it: stock generate() hands the
    tokenizer on to forward with the model's inputs, where the Gaudi attention would refuse it."""
    tokenizer = train_tiny_tokenizer(chat_template=False)
    return model.generate(**inputs, tokenizer=tokenizer, stop_strings=["the", "\n"], **GREEDY, **kwargs)


def prompt_lookup(model, inputs, **kwargs):
    return model.generate(**inputs, prompt_lookup_num_tokens=3, **GREEDY, **kwargs)


# Padded batches where transformers allows them; batch 1 where it needs one (streamers, candidate decoding).
BATCHED_FEATURES = {
    "inputs_embeds": from_embeddings,
    "beam_search": beam_search,
    "dict_output_with_scores": dict_output,
    "static_cache": static_cache,
    "inputs_embeds_bucketed_cache": embeddings_into_bucketed_cache,
}
SINGLE_FEATURES = {"streamer": streamed, "prompt_lookup": prompt_lookup, "stop_strings": stop_strings}


def assert_same_output(output, reference) -> None:
    """Tokens exactly; a feature's float outputs (scores), when it returns them, within fp32 error."""
    if isinstance(reference, tuple):
        assert torch.equal(output[0], reference[0])
        torch.testing.assert_close(output[1], reference[1], rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(output, reference)


def check_feature(model_type, feature, inputs, monkeypatch, **config) -> None:
    ours, stock = build_pair(model_type, **config)
    reference = (from_embeddings if feature is embeddings_into_bucketed_cache else feature)(stock, inputs)
    with count_attention_paths(monkeypatch, profile=False) as counts:
        default = feature(ours, inputs)
    assert_same_output(default, reference)
    assert counts["default"] > 0 and counts["fused"] == 0
    with count_attention_paths(monkeypatch, profile=False) as counts:
        flash = feature(ours, inputs, use_flash_attention=True)
    assert_same_output(flash, reference)
    if model_type in SOFT_CAPPED:
        assert counts["fused"] == 0  # soft-capped logits: the default path, with one warning (test_model_families)
    else:
        assert counts["fused"] > 0 and counts["default"] == 0


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("feature", BATCHED_FEATURES)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_batched_feature_matches_stock(model_type, feature, monkeypatch):
    check_feature(model_type, BATCHED_FEATURES[feature], left_padded_batch([12, 5, 9], seed=4), monkeypatch)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("feature", SINGLE_FEATURES)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_single_sequence_feature_matches_stock(model_type, feature, monkeypatch):
    # A repeating prompt, so that prompt lookup finds candidates in it.
    inputs = left_padded_batch([6], seed=5)
    inputs = {name: tensor.repeat(1, 2) for name, tensor in inputs.items()}
    check_feature(model_type, SINGLE_FEATURES[feature], inputs, monkeypatch)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("model_type", FAMILIES)
def test_assisted_decoding_matches_stock(model_type, monkeypatch):
    """A stock eager assistant, so the fused-path counts below are the main model's alone."""
    ours, stock = build_pair(model_type)
    _, assistant = build_pair(model_type)
    inputs = left_padded_batch([10], seed=6)
    reference = stock.generate(**inputs, assistant_model=assistant, **GREEDY)
    assert torch.equal(reference, stock.generate(**inputs, **GREEDY))  # greedy assisted decoding changes nothing
    with count_attention_paths(monkeypatch, profile=False) as counts:
        flash = ours.generate(**inputs, assistant_model=assistant, use_flash_attention=True, **GREEDY)
    assert torch.equal(flash, reference)
    if model_type not in SOFT_CAPPED:
        assert counts["fused"] > 0 and counts["default"] == 0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_static_cache_of_windowed_layers_only_holds_the_whole_generation(monkeypatch):
    """Every layer of this Mistral attends within 5 tokens, and a static cache's windowed layers report 5 as their
    length: the cache still takes the 12-token prompt and each new token, with the stock class's tokens."""
    inputs = left_padded_batch([12, 5, 9], seed=4)
    check_feature("mistral", static_cache, inputs, monkeypatch, **SLIDING_WINDOW_CONFIGS["mistral"])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_static_cache_of_windowed_layers_only_takes_a_next_turn_past_its_length(monkeypatch):
    """Its windowed layers roll, as stock's do: a second generate() from it runs past the cache's max_cache_len."""
    inputs = left_padded_batch([12, 5, 9], seed=4)
    check_feature("mistral", static_cache_next_turn, inputs, monkeypatch, **SLIDING_WINDOW_CONFIGS["mistral"])


@pytest.mark.parametrize("bucket_size", [1, 4])
def test_a_static_cache_length_read_before_an_update_keeps_its_value(bucket_size):
    """transformers' static layers hand out their length as the very tensor `update` advances in place: Inkling reads
    its query positions' offset before a layer's update and counts with it after, one position ahead with stock's
    static cache (its decode steps' logits 1e-3 from its dynamic cache's). Ours hands out the length as it is."""
    config = tiny_llama_config()
    cache = BucketedStaticCache(config, max_cache_len=8, bucket_size=bucket_size)
    head_dim = config.hidden_size // config.num_attention_heads
    prompt = torch.randn(1, config.num_key_value_heads, 3, head_dim)
    cache.prepare_for_new_tokens(3)
    cache.update(prompt, prompt, 0)
    cache.prepare_for_new_tokens(1)
    offset, length = cache.get_query_offset(0), cache.get_seq_length(0)
    cache.update(prompt[:, :, :1], prompt[:, :, :1], 0)
    assert (int(offset), int(length), int(cache.get_seq_length(0))) == (3, 3, 4)
