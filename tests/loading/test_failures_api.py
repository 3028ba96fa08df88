"""Bad input through the Python API: model loading, adapters, argument checks and atomic writes.

Each table case names the input, the exception it must raise and the words its message must contain: the file or
value at fault and what is wrong with it, never an error from deep inside transformers or PEFT.
"""

import argparse
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from optimum.habana.cli.adapters import AdapterError, check_adapter_folder, check_adapter_matches
from optimum.habana.cli.common import check_finite_numbers, check_seed
from optimum.habana.cli.finetuning import data as finetuning_data
from optimum.habana.utils import atomic, model_loading
from optimum.habana.utils.atomic import atomic_write_text
from optimum.habana.utils.model_loading import CACHE_ENV_VAR, ModelResolutionError, resolve_model
from optimum.habana.utils.pretrained import load_model_and_tokenizer
from optimum.habana.utils.weight_files import weight_file_problem
from tests.finetuning.support import build_tokenizer, save_word_level_checkpoint
from tests.helpers import tiny_llama_config, write_gguf


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return save_word_level_checkpoint(tmp_path_factory.mktemp("tiny"), build_tokenizer())


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


def damaged_copy(tmp: Path, model: Path, damage: Callable[[Path], object]) -> Path:
    folder = Path(shutil.copytree(model, tmp / "damaged"))
    damage(folder)
    return folder


def truncate_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def shard(folder: Path) -> None:
    """One shard listed in an index, as save_pretrained writes large models, and a second shard that is missing."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {"lm_head.weight": "model-00001-of-00002.safetensors", "x": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def as_pytorch_bin(folder: Path) -> None:
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def unknown_dtype(folder: Path) -> None:
    """Damage only the header's content, not its length: what the header check cannot see, but loading does."""
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes().replace(b'"F32"', b'"Q32"', 1))


CASES = {
    "truncated model.safetensors": Case(
        lambda tmp, model, adapter: resolve_model(
            str(damaged_copy(tmp, model, lambda f: truncate_to_half(f / "model.safetensors")))
        ),
        ModelResolutionError,
        ["damaged/model.safetensors is truncated", "bytes of the", "the checkpoint is damaged"],
    ),
    "model.safetensors with a junk header": Case(
        lambda tmp, model, adapter: resolve_model(
            str(damaged_copy(tmp, model, lambda f: write(f / "model.safetensors", b"\x10" + bytes(7) + b"{junk" * 4)))
        ),
        ModelResolutionError,
        ["model.safetensors is damaged", "not valid safetensors JSON"],
    ),
    "model.safetensors shorter than its header length": Case(
        lambda tmp, model, adapter: resolve_model(
            str(damaged_copy(tmp, model, lambda f: write(f / "model.safetensors", b"abc")))
        ),
        ModelResolutionError,
        ["model.safetensors is damaged", "3 bytes"],
    ),
    "sharded checkpoint with a missing shard": Case(
        lambda tmp, model, adapter: resolve_model(str(damaged_copy(tmp, model, shard))),
        ModelResolutionError,
        ["model-00002-of-00002.safetensors is missing", "model.safetensors.index.json lists it"],
    ),
    "truncated pytorch_model.bin": Case(
        lambda tmp, model, adapter: resolve_model(
            str(damaged_copy(tmp, model, lambda f: (as_pytorch_bin(f), truncate_to_half(f / "pytorch_model.bin"))))
        ),
        ModelResolutionError,
        ["pytorch_model.bin is truncated or damaged", "zip directory"],
    ),
    "model.safetensors with a damaged header of the right length": Case(
        lambda tmp, model, adapter: load(damaged_copy(tmp, model, unknown_dtype)),
        ModelResolutionError,
        ["weights in", "damaged", "cannot be read", "Q32"],
    ),
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
        lambda tmp, model, adapter: finetuning_data.load_raw_datasets(
            train_file=str(write(tmp / "d.txt", b"fine\nna\xefve\n")),
            validation_file=None,
            dataset_name=None,
        ),
        finetuning_data.FineTuningError,
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


def test_whole_checkpoints_pass_the_weight_check(model_folder, tmp_path):
    """Single file, sharded safetensors and a torch.save archive: the check refuses only damage."""
    assert weight_file_problem(model_folder) is None
    model = LlamaForCausalLM.from_pretrained(model_folder)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    assert weight_file_problem(tmp_path / "sharded") is None
    bin_folder = damaged_copy(tmp_path, model_folder, as_pytorch_bin)
    assert weight_file_problem(bin_folder) is None
    load(bin_folder)


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


def test_a_misspelled_flag_is_named_with_the_flag_it_resembles(model_folder):
    """`use_flash_attentoin=True` reached the attention as an unknown argument ("this model family is not
    supported"), or was refused by transformers without the flag it meant."""
    from optimum.habana.transformers import GaudiLlamaForCausalLM

    words = re.escape(
        "`use_flash_attentoin` is not a keyword argument of optimum.habana's models: did you mean `use_flash_attention`?"
    )
    with pytest.raises(TypeError, match=words):
        GaudiLlamaForCausalLM.from_pretrained(model_folder, use_flash_attentoin=True)
    model = GaudiLlamaForCausalLM.from_pretrained(model_folder)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match=words):
        model(ids, use_flash_attentoin=True)
    with pytest.raises(TypeError, match=words):
        model.generate(ids, max_new_tokens=1, use_flash_attentoin=True)
    with pytest.raises(TypeError, match="did you mean `attn_softmax_bf16`"):
        model(ids, attn_softmax_fp16=True)
    with pytest.raises(TypeError, match=re.escape("`use_flash_attention` is not an argument of from_pretrained()")):
        GaudiLlamaForCausalLM.from_pretrained(model_folder, use_flash_attention=True)  # "unexpected keyword" before


@pytest.mark.parametrize("route", ["config argument", "set on the model's config"])
def test_a_flag_on_the_model_config_is_named_once_as_unread(route):
    """Nothing reads the model config's flags (they are the generation config's): one warning says so and where
    they go, and the default path runs as before."""
    from optimum.habana.kernels import dispatch
    from optimum.habana.transformers import GaudiLlamaForCausalLM
    from tests.helpers import left_padded_batch, tiny_llama_config

    if route == "config argument":
        model = GaudiLlamaForCausalLM(tiny_llama_config(use_flash_attention=True)).eval()
    else:
        model = GaudiLlamaForCausalLM(tiny_llama_config()).eval()
        model.config.use_flash_attention = True
    dispatch.warn_once.cache_clear()
    words = "config.use_flash_attention=True is not read: the attention flags are the generation config's"
    with pytest.warns(UserWarning, match=re.escape(words)) as record, torch.no_grad():
        model(**left_padded_batch([5, 3]))
        model(**left_padded_batch([5, 3]))
    assert len([warning for warning in record if "is not read" in str(warning.message)]) == 1
