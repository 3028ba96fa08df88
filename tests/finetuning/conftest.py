"""Fixtures of the run_lora_clm.py tests: the script as a module, the word-level tokenizer, a tiny checkpoint."""

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from tests.finetuning.support import build_tokenizer, save_word_level_checkpoint
from tests.helpers import load_script


@pytest.fixture(scope="module")
def script():
    """run_lora_clm.py as a module, for calling main(argv, callbacks) in this process."""
    return load_script("examples/language-modeling/run_lora_clm.py")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer) -> Path:
    """A stock Llama checkpoint, as a user would pass it, with the tokenizer beside it."""
    return save_word_level_checkpoint(tmp_path_factory.mktemp("tiny_llama"), tokenizer)
