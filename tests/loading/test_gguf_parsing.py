"""`parsed_once()`: transformers' GGUF loading parses a file once and builds each tensor-name map once inside it, with
the same results, and the gguf module is itself again afterwards. The embedded model's conversion goes through it:
test_model_loading.py checks that conversion's weights against the GGUF's and its answer."""

import gguf
import pytest
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map, load_gguf_checkpoint

from optimum.habana.utils.gguf_reading import parsed_once
from tests.helpers import write_gguf


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """gguf's reader and name map, counting their constructions (the originals underneath)."""
    counts = {"readers": 0, "name maps": 0}
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(*args, **kwargs):
        counts["readers"] += 1
        return reader_class(*args, **kwargs)

    def tensor_name_map(*args):
        counts["name maps"] += 1
        return name_map(*args)

    monkeypatch.setattr(gguf, "GGUFReader", reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", tensor_name_map)
    return counts


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    return LlamaForCausalLM(config)


def test_transformers_parses_a_file_once_inside_and_gets_the_same_config(tmp_path, counted):
    path = str(write_gguf(tmp_path / "tiny.gguf", "llama"))
    alone = [load_gguf_checkpoint(path) for _ in range(3)]
    assert counted["readers"] == 3
    with parsed_once():
        inside = [load_gguf_checkpoint(path) for _ in range(3)]
    assert counted["readers"] == 4
    assert inside == alone


def test_the_weights_map_is_built_once_inside_and_maps_the_same_names(counted):
    model = tiny_llama()
    alone = get_gguf_hf_weights_map(model, TensorProcessor())
    assert counted["name maps"] > 10  # once per submodule
    before = counted["name maps"]
    with parsed_once():
        inside = get_gguf_hf_weights_map(model, TensorProcessor())
    assert counted["name maps"] == before + 1
    assert inside == alone and inside["blk.1.attn_q.weight"] == "model.layers.1.self_attn.q_proj.weight"


def test_the_gguf_module_is_restored_after_the_block_and_after_an_error(tmp_path):
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with parsed_once():
        assert gguf.GGUFReader is not reader_class and gguf.get_tensor_name_map is not name_map
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    with pytest.raises(ValueError, match="conversion failed"), parsed_once():
        raise ValueError("conversion failed")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    # A new block parses again: a file changed between two conversions is read as it is now.
    path = write_gguf(tmp_path / "tiny.gguf", "llama")
    with parsed_once():
        first = gguf.GGUFReader(path)
    with parsed_once():
        assert gguf.GGUFReader(path) is not first
