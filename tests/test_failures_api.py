"""Bad input through the Python API: model loading, adapters, argument checks and atomic writes.

Each table case names the input, the exception it must raise and the words its message must contain: the file or
value at fault and what is wrong with it, never an error from deep inside transformers or PEFT.
"""

import argparse
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from optimum.habana.example_support import finetuning
from optimum.habana.example_support.adapters import AdapterError, check_adapter_folder, check_adapter_matches
from optimum.habana.example_support.arguments import check_finite_numbers, check_seed
from optimum.habana.utils import atomic, model_loading
from optimum.habana.utils.atomic import atomic_write_text
from optimum.habana.utils.model_loading import CACHE_ENV_VAR, ModelResolutionError, resolve_model
from optimum.habana.utils.pretrained import load_model_and_tokenizer

from .test_model_loading import write_gguf
from .test_run_lora_clm import build_tokenizer, save_tiny_checkpoint
from .utils import tiny_llama_config


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), build_tokenizer())


@pytest.fixture(scope="module")
def adapter_folder(tmp_path_factory, model_folder) -> Path:
    """A LoRA adapter (rank 4) of the tiny Llama, saved as PEFT saves it."""
    folder = tmp_path_factory.mktemp("adapter")
    model = get_peft_model(LlamaForCausalLM.from_pretrained(model_folder), LoraConfig(r=4, target_modules=["q_proj"]))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))


def load(path: Path) -> None:
    load_model_and_tokenizer(str(path), dtype=torch.float32, device=torch.device("cpu"))


def copy_adapter(tmp: Path, source: Path, damage: Callable[[Path], object]) -> Path:
    folder = Path(shutil.copytree(source, tmp / "adapter"))
    damage(folder)
    return folder


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def truncated_gguf(tmp: Path) -> Path:
    path = write_gguf(tmp / "cut.gguf", arch="llama")
    os.truncate(path, path.stat().st_size - 64)
    return path


@dataclass
class Case:
    call: Callable[[Path, Path, Path], object]  # (tmp_path, model_folder, adapter_folder)
    error: type[Exception]
    words: list[str]


@dataclass
class Numbers:
    learning_rate: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.99)
    steps: int = 3


CASES = {
    "truncated .gguf": Case(
        lambda tmp, model, adapter: resolve_model(str(truncated_gguf(tmp))),
        ModelResolutionError,
        ["cut.gguf", "truncated or damaged"],
    ),
    "garbage .gguf": Case(
        lambda tmp, model, adapter: resolve_model(str(write(tmp / "junk.gguf", b"GGUF" + bytes(40)))),
        ModelResolutionError,
        ["junk.gguf", "not a valid GGUF file"],
    ),
    "checkpoint folder without a tokenizer": Case(
        lambda tmp, model, adapter: load(
            shutil.copytree(model, tmp / "bare", ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
        ),
        ModelResolutionError,
        ["bare", "has no tokenizer"],
    ),
    "junk tokenizer.json": Case(
        lambda tmp, model, adapter: load(
            write(Path(shutil.copytree(model, tmp / "junk-tokenizer")) / "tokenizer.json", b"{junk").parent
        ),
        ModelResolutionError,
        ["junk-tokenizer", "tokenizer files", "cannot be loaded"],
    ),
    "junk adapter_config.json": Case(
        lambda tmp, model, adapter: check_adapter_folder(
            copy_adapter(tmp, adapter, lambda f: (f / "adapter_config.json").write_text("{")), "--peft_model"
        ),
        AdapterError,
        ["adapter_config.json", "not valid JSON"],
    ),
    "adapter_config.json holding a list": Case(
        lambda tmp, model, adapter: check_adapter_folder(
            copy_adapter(tmp, adapter, lambda f: (f / "adapter_config.json").write_text("[]")), "--peft_model"
        ),
        AdapterError,
        ["adapter_config.json", "JSON list"],
    ),
    "adapter config without a peft_type": Case(
        lambda tmp, model, adapter: check_adapter_folder(
            copy_adapter(tmp, adapter, lambda f: (f / "adapter_config.json").write_text('{"r": 4}')), "--peft_model"
        ),
        AdapterError,
        ["no known peft_type", "None"],
    ),
    "adapter folder without weights": Case(
        lambda tmp, model, adapter: check_adapter_folder(
            copy_adapter(tmp, adapter, lambda f: (f / "adapter_model.safetensors").unlink()), "--peft_model"
        ),
        AdapterError,
        ["--peft_model", "no weights", "adapter_model.safetensors"],
    ),
    "truncated adapter weights": Case(
        lambda tmp, model, adapter: check_adapter_folder(
            copy_adapter(tmp, adapter, lambda f: os.truncate(f / "adapter_model.safetensors", 50)), "--peft_model"
        ),
        AdapterError,
        ["adapter_model.safetensors", "damaged or truncated"],
    ),
    "adapter of another base model": Case(
        lambda tmp, model, adapter: check_adapter_matches(
            adapter, LlamaForCausalLM(tiny_llama_config(hidden_size=32, vocab_size=300)), "--peft_model"
        ),
        AdapterError,
        ["--peft_model", "does not fit", "in_features=32", "another base model"],
    ),
    "adapter targeting a module the model lacks": Case(
        lambda tmp, model, adapter: check_adapter_matches(
            adapter, LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1)), "--peft_model"
        ),
        AdapterError,
        ["layers.1.self_attn.q_proj", "does not have"],
    ),
    "nan in a dataclass": Case(
        lambda tmp, model, adapter: check_finite_numbers(Numbers(learning_rate=float("nan"))),
        ValueError,
        ["--learning_rate", "finite", "nan"],
    ),
    "inf in a tuple field": Case(
        lambda tmp, model, adapter: check_finite_numbers(Numbers(betas=(0.9, float("inf")))),
        ValueError,
        ["--betas", "inf"],
    ),
    "-inf in an argparse namespace": Case(
        lambda tmp, model, adapter: check_finite_numbers(argparse.Namespace(temperature=float("-inf"), top_k=5)),
        ValueError,
        ["--temperature", "-inf"],
    ),
    "seed out of range": Case(
        lambda tmp, model, adapter: check_seed(2**32, "--seed"), ValueError, ["--seed", "4294967296", "4294967295"]
    ),
    "non-UTF-8 data file": Case(
        lambda tmp, model, adapter: finetuning.load_raw_datasets(
            train_file=str(write(tmp / "d.txt", b"fine\nna\xefve\n")),
            validation_file=None,
            dataset_name=None,
        ),
        finetuning.FineTuningError,
        ["d.txt", "not UTF-8", "line 2", "column 3"],
    ),
    "conversion that fails on the file": Case(
        lambda tmp, model, adapter: resolve_model(str(write_gguf(tmp / "odd.gguf", arch="llama"))),
        ModelResolutionError,
        ["odd.gguf", "could not be converted", "KeyError", "damaged or truncated"],
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input(name, tmp_path, model_folder, adapter_folder, monkeypatch):
    case = CASES[name]

    def missing_tensor(gguf_path, output_dir):
        raise KeyError("blk.0.attn_q.weight")

    monkeypatch.setattr(model_loading, "_convert_gguf", missing_tensor)
    with pytest.raises(case.error) as error:
        case.call(tmp_path, model_folder, adapter_folder)
    message = str(error.value)
    assert "\n" not in message
    for word in case.words:
        assert word in message, (word, message)


def test_matching_adapter_and_good_values_pass(adapter_folder, model_folder):
    """The checks refuse only what is wrong: the adapter fits its own base model, wrapped or not."""
    assert check_adapter_folder(adapter_folder, "--peft_model")["r"] == 4
    base = LlamaForCausalLM.from_pretrained(model_folder)
    check_adapter_matches(adapter_folder, base, "--peft_model")
    check_adapter_matches(adapter_folder, get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])), "-")
    check_finite_numbers(Numbers(), argparse.Namespace(temperature=0.7, name="x"))
    check_seed(0)
    check_seed(2**32 - 1)


# --- atomic writes -----------------------------------------------------------------------------------------------


def test_atomic_write_replaces_a_symlink_instead_of_writing_through_it(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("precious")
    link = tmp_path / "results.json"
    link.symlink_to(target)
    atomic_write_text(link, json.dumps({"throughput": 1.0}))
    assert target.read_text() == "precious"
    assert not link.is_symlink() and json.loads(link.read_text()) == {"throughput": 1.0}


def test_interrupted_atomic_write_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    path.write_text("previous")

    def interrupted(source, destination):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(path, "new")
    assert path.read_text() == "previous"
    assert [entry.name for entry in tmp_path.iterdir()] == ["results.json"]


def test_atomic_write_follows_the_umask(tmp_path):
    previous = os.umask(0o077)
    try:
        path = atomic_write_text(tmp_path / "a.json", "{}")
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == 0o600
    assert atomic_write_text(tmp_path / "b.json", "{}").stat().st_mode & 0o777 == 0o666 & ~previous
