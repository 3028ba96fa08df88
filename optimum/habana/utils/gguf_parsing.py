"""One parse of a GGUF file per conversion, where transformers parses it three times.

Converting a GGUF checkpoint with transformers 5.23 (`from_pretrained(..., gguf_file=...)` for the model, then for
the tokenizer) constructs `gguf.GGUFReader` over the same file three times (the config, the weights, the tokenizer),
and each construction builds a numpy view of every metadata value: 441,714 of them for SmolLM2's vocabulary. Mapping
the weights' names builds gguf's `TensorNameMap` again for every submodule of the model (397 times for SmolLM2), the
same map each time. On the embedded SmolLM2 the conversion took 22.2 s, and 9.3 s with each done once; every file it
writes was byte-identical.

transformers imports `GGUFReader` and `get_tensor_name_map` from the gguf module inside the functions that use them,
at each call, so `parsed_once()` swaps the module's two names for memoizing ones for the length of one conversion and
restores them after. Both are pure reads of the file (the reader maps it read-only), so a caller in another thread
meanwhile gets the same results; a lock keeps two conversions from interleaving the swap and its undoing.
"""

import contextlib
import functools
import threading
from collections.abc import Iterator

import gguf


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
