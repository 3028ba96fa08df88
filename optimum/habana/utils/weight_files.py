"""Check that a checkpoint folder's weight files are whole, from their headers, before `from_pretrained` reads them.

A truncated or damaged `model.safetensors` otherwise surfaces as a `SafetensorError` traceback from deep inside
transformers, after the tokenizer and the config have loaded. Reading a safetensors header costs a few kilobytes:
its JSON gives every tensor's byte range, so a file shorter than the last range is truncated.
"""

import json
import struct
import zipfile
from pathlib import Path


SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_INDEX = "pytorch_model.bin.index.json"
_HEADER_LENGTH_BYTES = 8
# safetensors itself refuses headers above 100 MB; a larger length means the first bytes are not a header.
_MAX_HEADER_BYTES = 100_000_000


def weight_file_problem(folder: Path) -> str | None:
    """The first damaged or missing weight file of a checkpoint folder, said in one sentence; None when all are whole.

    Looks at what `from_pretrained` would read: the shards an index lists, else `model.safetensors`, else
    `pytorch_model.bin` (a zip archive since PyTorch 1.6, whose directory sits at its end).
    """
    for index_name in (SAFETENSORS_INDEX, PYTORCH_INDEX):
        index = folder / index_name
        if index.is_file():
            return _index_problem(index)
    if (folder / "model.safetensors").is_file():
        return safetensors_problem(folder / "model.safetensors")
    if (folder / "pytorch_model.bin").is_file():
        return pytorch_archive_problem(folder / "pytorch_model.bin")
    return None


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot be whole (unreadable header, shorter than its tensors), or None."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            head = file.read(_HEADER_LENGTH_BYTES)
            if len(head) < _HEADER_LENGTH_BYTES:
                return f"{path} is damaged: {size} bytes, too short for a safetensors header"
            (header_length,) = struct.unpack("<Q", head)
            if header_length > min(_MAX_HEADER_BYTES, size - _HEADER_LENGTH_BYTES):
                return f"{path} is damaged or truncated: its header claims {header_length} bytes of a {size}-byte file"
            header = json.loads(file.read(header_length))
    except OSError as error:
        return f"{path} cannot be read ({error.strerror or error})"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return f"{path} is damaged: its header is not valid safetensors JSON"
    if not isinstance(header, dict):
        return f"{path} is damaged: its header is not valid safetensors JSON"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets", ())) == 2
    ]
    expected = _HEADER_LENGTH_BYTES + header_length + max(ends, default=0)
    if size < expected:
        return f"{path} is truncated: {size} bytes of the {expected} its header describes"
    return None


def pytorch_archive_problem(path: Path) -> str | None:
    """Why a torch.save zip archive cannot be whole, or None (older non-zip pickles are not checked)."""
    try:
        with open(path, "rb") as file:
            is_zip_start = file.read(4) == b"PK\x03\x04"
        if not is_zip_start:
            return None
        with zipfile.ZipFile(path):
            return None
    except OSError as error:
        return f"{path} cannot be read ({error.strerror or error})"
    except zipfile.BadZipFile:
        return f"{path} is truncated or damaged: its zip directory is missing or unreadable"


def _index_problem(index: Path) -> str | None:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return f"{index} is damaged: it is not a JSON object with a weight_map"
    for shard in shards:
        path = index.parent / shard
        if not path.is_file():
            return f"{path} is missing ({index.name} lists it)"
        check = safetensors_problem if path.suffix == ".safetensors" else pytorch_archive_problem
        if problem := check(path):
            return problem
    return None


__all__ = ["pytorch_archive_problem", "safetensors_problem", "weight_file_problem"]
