"""A GGUF file read as little as it can be: its layout checked before a conversion, and one parse per conversion.

The layout. `gguf.GGUFReader` builds a numpy view of every metadata value, the tokenizer's 49,152 strings included
(3-5 s for the embedded SmolLM2), and transformers parses the file again to convert it. Refusing a damaged or truncated
file before converting needs only the structure: the header, the metadata values skipped over by their sizes, and the
tensors' shapes, types and offsets, which tell how long the file must be (the block sizes are the gguf library's).

One parse. Converting a GGUF checkpoint with transformers 5.23 (`from_pretrained(..., gguf_file=...)` for the model,
then for the tokenizer) constructs `gguf.GGUFReader` over the same file three times (the config, the weights, the
tokenizer), and each construction builds a numpy view of every metadata value: 441,714 of them for SmolLM2's
vocabulary. Mapping the weights' names builds gguf's `TensorNameMap` again for every submodule of the model (397 times
for SmolLM2), the same map each time. On the embedded SmolLM2 the conversion took 22.2 s, and 9.3 s with each done
once; every file it writes was byte-identical.

transformers imports `GGUFReader` and `get_tensor_name_map` from the gguf module inside the functions that use them,
at each call, so `parsed_once()` swaps the module's two names for memoizing ones for the length of one conversion and
restores them after. Both are pure reads of the file (the reader maps it read-only), so a caller in another thread
meanwhile gets the same results; a lock keeps two conversions from interleaving the swap and its undoing.
"""

import contextlib
import functools
import mmap
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf


# Sizes of the scalar metadata types, by gguf's type numbers.
_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class GgufLayout:
    architecture: str  # `general.architecture`, "unknown" when the field is missing
    tensor_count: int
    required_bytes: int  # where the last tensor's data ends


class _Cursor:
    """Reads little-endian values from the mapped file; a read past its end is a ValueError."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.offset = data, 0

    def take(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            raise ValueError(f"the file ends at byte {len(self.data)}, inside its metadata")
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += size
        return value

    def string(self) -> bytes:
        length = int(self.take("<Q"))
        if self.offset + length > len(self.data):
            raise ValueError(f"the file ends at byte {len(self.data)}, inside its metadata")
        value = self.data[self.offset : self.offset + length]
        self.offset += length
        return value

    def skip_value(self, kind: int) -> None:
        if kind == gguf.GGUFValueType.STRING:
            self.string()
        elif kind == gguf.GGUFValueType.ARRAY:
            item_kind, count = int(self.take("<I")), int(self.take("<Q"))
            if item_kind in _SCALAR_FORMATS:  # fixed size: one jump
                self.offset += count * struct.calcsize(_SCALAR_FORMATS[item_kind])
            else:
                for _ in range(count):
                    self.skip_value(item_kind)
        elif kind in _SCALAR_FORMATS:
            self.take(_SCALAR_FORMATS[kind])
        else:
            raise ValueError(f"unknown metadata type {kind}")


def read_gguf_layout(path: Path) -> GgufLayout:
    """The file's architecture and the bytes its tensors need; a ValueError says what is wrong with a file that is
    not a GGUF file, is cut short or holds a value of an unknown type."""
    with open(path, "rb") as file:
        if file.seek(0, 2) == 0:
            raise ValueError("the file is empty")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _layout(_Cursor(data), len(data))


def _layout(cursor: _Cursor, file_size: int) -> GgufLayout:
    if cursor.take("<I") != gguf.GGUF_MAGIC:
        raise ValueError("it does not start with GGUF's magic number")
    version = cursor.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not one this reader knows (2, 3)")
    tensor_count, value_count = int(cursor.take("<Q")), int(cursor.take("<Q"))
    architecture, alignment = "unknown", gguf.GGUF_DEFAULT_ALIGNMENT
    for _ in range(value_count):
        key, kind = cursor.string(), int(cursor.take("<I"))
        if key == b"general.architecture" and kind == gguf.GGUFValueType.STRING:
            architecture = cursor.string().decode("utf-8", errors="replace")
        elif key == b"general.alignment" and kind == gguf.GGUFValueType.UINT32:
            alignment = int(cursor.take("<I")) or alignment
        else:
            cursor.skip_value(kind)
    ends = [0]
    for _ in range(tensor_count):
        cursor.string()  # the tensor's name
        dimensions = int(cursor.take("<I"))
        elements = 1
        for _ in range(dimensions):
            elements *= int(cursor.take("<Q"))
        kind, offset = int(cursor.take("<I")), int(cursor.take("<Q"))
        try:
            block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"a tensor of unknown type {kind}") from None
        ends.append(offset + elements // block_size * type_size)
    data_start = -(-cursor.offset // alignment) * alignment
    required = data_start + max(ends)
    if required > file_size:
        raise ValueError(f"its tensors need {required} bytes and the file has {file_size}")
    return GgufLayout(architecture, tensor_count, required)


_SWAP = threading.RLock()


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, a GGUF file is parsed once per mode and each tensor-name map built once."""
    with _SWAP:
        reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], gguf.GGUFReader] = {}

        def reader(path, mode: str = "r") -> gguf.GGUFReader:
            key = (str(path), mode)
            if key not in readers:
                readers[key] = reader_class(path, mode)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


__all__ = ["GgufLayout", "parsed_once", "read_gguf_layout"]
