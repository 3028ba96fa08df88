"""The GGUF structure check that runs before a conversion (`utils/gguf_reading.py`)."""

import gguf
import numpy as np
import pytest

from optimum.habana.utils.gguf_reading import read_gguf_layout
from tests.helpers import write_gguf


def test_the_layout_agrees_with_the_gguf_librarys_reader(tmp_path):
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, arch="qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"token{index}" for index in range(300)])  # an array of strings, skipped item by item
    writer.add_array("tokenizer.ggml.scores", [0.5] * 300)  # an array of numbers, skipped in one jump
    writer.add_tensor("a", np.zeros((3, 5), dtype=np.float32))
    writer.add_tensor("b", np.zeros((64,), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(path)
    layout = read_gguf_layout(path)
    assert layout.architecture == "qwen2" == str(reader.get_field("general.architecture").contents())
    assert layout.tensor_count == len(reader.tensors) == 2
    last = max(reader.tensors, key=lambda tensor: tensor.data_offset)
    assert layout.required_bytes == last.data_offset + last.n_bytes


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: data[:-1], "its tensors need"),  # cut inside the last tensor's data
        (lambda data: data[:40], "inside its metadata"),  # cut inside the metadata
        (lambda data: b"not a gguf file at all", "does not start with GGUF's magic number"),
        (lambda data: b"", "the file is empty"),
        (lambda data: data[:4] + (9).to_bytes(4, "little") + data[8:], "GGUF version 9"),
    ],
)
def test_a_damaged_file_is_named_by_what_is_wrong(tmp_path, damage, message):
    data = write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(damage(data))
    with pytest.raises(ValueError, match=message):
        read_gguf_layout(damaged)
