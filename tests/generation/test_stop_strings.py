"""Stop strings without transformers' vocabulary-wide tables: `TailStopStringCriteria` must stop every row at the
step where transformers' `StopStringCriteria` stops it, on the embedded SmolLM2's byte-level tokenizer and on
sentencepiece-style ones, and generate() with stop strings must return stock generate()'s tokens.
"""

import copy
import json
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    StoppingCriteriaList,
    StopStringCriteria,
)

from optimum.habana.transformers.generation.stop_strings import TailStopStringCriteria
from optimum.habana.transformers.models import GAUDI_CAUSAL_LM_CLASSES
from tests.helpers import TOKENIZER_SENTENCES


# Stop strings over several tokens, ending mid-token, with byte-level Ġ/Ċ text (spaces, newlines) and the literal
# character "Ġ", of several UTF-8 bytes (emoji, CJK, accents), longer than any row, matching a special token's text.
BYTE_LEVEL_STOP_SETS = [
    ["stop"],
    ["\n\n", " the"],
    ["🙂", "é", "你好"],
    ["Ġ", "ing."],
    ["a" * 40],
    ["<|im_end|>", "end|>x", "s."],
    ["the lazy dog", "o", "top"],
]
SENTENCEPIECE_STOP_SETS = [["stop"], [" the", "x."], ["ver t", "a" * 30], ["é", "🙂", "top"]]
# What the rows are made of: the stop strings, pieces of them and words that overlap them.
WORDS = ["st", "op", "stop", "topper", "las", "the", " the", "\n", "\n\n", "🙂", "é", "你", "好", "ing", ".", "a"]
WORDS += ["aaaa", "<|im_end|>", "end", "|>", "x", "s", " ", "hello", " world", "Ġ", "dog", " lazy", "🙂🙂"]
WORDS += ["over", " t", "~", "~~~~", "~~~~~~~~"]


def random_rows(tokenizer, stops: list[str], rng: random.Random, rows: int = 24) -> torch.Tensor:
    """A left-padded batch of token rows holding the stop strings, their pieces and their neighbours; some rows
    also hold ids past the vocabulary, and the padding is random tokens (a window may reach into it)."""
    pieces = WORDS + stops + [stop[:cut] for stop in stops for cut in range(1, len(stop))]
    vocabulary = len(tokenizer)
    lines = []
    for _ in range(rows):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 10)))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] or [0]
        if rng.random() < 0.25:
            replaced = [rng.randrange(vocabulary), vocabulary + rng.randrange(3)]  # a token, an id past them
            ids = [rng.choice(replaced) if rng.random() < 0.3 else token for token in ids]
        lines.append(ids)
    width = max(len(ids) for ids in lines)
    return torch.tensor([[rng.randrange(vocabulary) for _ in range(width - len(ids))] + ids for ids in lines])


def assert_same_decisions(tokenizer, stops: list[str], seed: int) -> int:
    """Both criteria on every prefix of random batches (one prefix per generation step); how many stops they made."""
    ours, reference = TailStopStringCriteria(tokenizer, stops), StopStringCriteria(tokenizer, stops)
    rng = random.Random(seed)
    stopped = decisions = 0
    for _ in range(3):
        batch = random_rows(tokenizer, stops, rng)
        for step in range(1, batch.shape[1] + 1):
            expected = reference(batch[:, :step], None)
            got = ours(batch[:, :step], None)
            assert got.dtype == torch.bool and got.shape == (batch.shape[0],)
            assert torch.equal(got, expected), (stops, batch[:, :step].tolist(), got, expected)
            stopped += int(expected.sum())
            decisions += expected.numel()
    assert 0 < stopped < decisions  # the batches exercise both answers
    return stopped


def sentencepiece_style(byte_fallback: bool) -> PreTrainedTokenizerFast:
    """A Llama-style tokenizer trained here: "▁" for spaces, and characters it has no token for written as
    `<0xNN>` byte tokens (`byte_fallback`, transformers matches bytes) or as `<unk>` (it matches text). Its "~"
    tokens have no text, so that runs of them exhaust the window of tokens transformers reads."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    fallback = [decoders.ByteFallback()] if byte_fallback else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("~", ""), decoders.Replace("▁", " "), *fallback, decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    sentences = TOKENIZER_SENTENCES + ["stop the topper at last", "ever the river", "~ ~~ ~~~"]
    tokenizer.train_from_iterator(
        sentences, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    )
    if byte_fallback:
        state = json.loads(tokenizer.to_str())
        vocabulary = state["model"]["vocab"]
        for byte in range(256):
            vocabulary.setdefault(f"<0x{byte:02X}>", len(vocabulary))
        state["model"]["byte_fallback"] = True
        tokenizer = Tokenizer.from_str(json.dumps(state))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def smollm2_path(default_model):
    return default_model[1].path


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.mark.parametrize("seed, stops", list(enumerate(BYTE_LEVEL_STOP_SETS)))
def test_same_decisions_as_transformers_byte_level(smollm2_tokenizer, seed, stops):
    assert StopStringCriteria._get_stop_string_matching_mode(smollm2_tokenizer) == "byte_level"
    assert_same_decisions(smollm2_tokenizer, stops, seed)


@pytest.mark.parametrize("byte_fallback, mode", [(True, "byte_fallback"), (False, None)])
def test_same_decisions_as_transformers_sentencepiece_style(byte_fallback, mode):
    tokenizer = sentencepiece_style(byte_fallback)
    assert StopStringCriteria._get_stop_string_matching_mode(tokenizer) == mode
    for seed, stops in enumerate(SENTENCEPIECE_STOP_SETS):
        if not byte_fallback:  # "🙂" and "é" have no token there (see the next test)
            stops = [stop for stop in stops if stop.isascii()]
        assert_same_decisions(tokenizer, stops, seed)


def test_stop_string_no_token_can_end():
    """transformers refuses, before generating, a stop string no token's text can end (here an emoji in a
    vocabulary without bytes): it could never match. Ours accepts it and never stops on it."""
    tokenizer = sentencepiece_style(byte_fallback=False)
    with pytest.raises(ValueError, match="unable to identify tokens"):
        StopStringCriteria(tokenizer, ["🙂"])
    ids = torch.tensor([tokenizer("stop 🙂 🙂", add_special_tokens=False)["input_ids"]])
    ours = TailStopStringCriteria(tokenizer, ["🙂"])
    assert not any(ours(ids[:, :step], None).item() for step in range(1, ids.shape[1] + 1))


@pytest.fixture(scope="module")
def smollm2_models(smollm2_path):
    """The embedded SmolLM2 as the Gaudi class and as the stock class."""
    ours = GAUDI_CAUSAL_LM_CLASSES["llama"].from_pretrained(smollm2_path).eval()
    stock = AutoModelForCausalLM.from_pretrained(smollm2_path).eval()
    return ours, stock


def test_generate_with_stop_strings_matches_stock(smollm2_models, smollm2_tokenizer, monkeypatch):
    """A batch whose rows stop at different steps ("Paris." after two tokens; "ven, ei" inside " eight", the 11th):
    the stock tokens, without transformers' tables ever being built."""
    ours, stock = smollm2_models
    tokenizer = smollm2_tokenizer
    tokenizer.padding_side = "left"
    inputs = tokenizer(
        ["Count from one to ten in words: one, two,", "The capital of France is"], return_tensors="pt", padding=True
    )
    arguments = {
        "max_new_tokens": 16,
        "do_sample": False,
        "tokenizer": tokenizer,
        "stop_strings": ["ven, ei", "Paris.", "🙂"],
    }
    reference = stock.generate(**inputs, **arguments)

    steps = []
    real_call = TailStopStringCriteria.__call__
    monkeypatch.setattr(
        TailStopStringCriteria, "__call__", lambda self, *a, **k: steps.append(1) or real_call(self, *a, **k)
    )
    monkeypatch.setattr(StopStringCriteria, "__init__", lambda *a, **k: pytest.fail("transformers' tables built"))
    output = ours.generate(**inputs, **arguments)

    assert torch.equal(output, reference)
    new = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert new == [" three, four, five, six, seven, eight", " Paris."]
    assert len(steps) == 11  # the batch's steps, until its last row stopped


def test_callers_stop_string_criteria_takes_precedence(smollm2_models, smollm2_tokenizer):
    """As in stock: a `StopStringCriteria` passed to generate() replaces the one the config's stop strings make."""
    ours, _ = smollm2_models
    config = copy.deepcopy(ours.generation_config)
    config.stop_strings, config.max_length, config._eos_token_tensor = ["x."], 32, None
    kinds = [type(c) for c in ours._get_stopping_criteria(config, StoppingCriteriaList(), smollm2_tokenizer)]
    assert kinds.count(TailStopStringCriteria) == 1 and StopStringCriteria not in kinds
    custom = StopStringCriteria(smollm2_tokenizer, ["x."])
    criteria = ours._get_stopping_criteria(config, StoppingCriteriaList([custom]), smollm2_tokenizer)
    assert custom in criteria and not any(isinstance(c, TailStopStringCriteria) for c in criteria)
    with pytest.raises(ValueError, match="could not locate a tokenizer"):
        ours._get_stopping_criteria(config, StoppingCriteriaList(), None)
