"""Shared test helpers: tiny random models of every family, counters of which attention path ran, the example
scripts loaded as modules, and the checkpoints, tokenizers and files they are given."""

import importlib.util
import json
import os
import socket
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from filelock import FileLock
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedConfig, PreTrainedTokenizerFast

from optimum.habana import gaudi_model_class
from optimum.habana.kernels import dispatch, local_attention, variable_length
from optimum.habana.transformers import attention, paged_attention
from optimum.habana.transformers.growing_cache import GrowingCache
from optimum.habana.transformers.models import GAUDI_CAUSAL_LM_CLASSES
from optimum.habana.utils.model_loading import CACHE_ENV_VAR, ResolvedModel, resolve_model


# A fused kernel ran on CPU: PyTorch's flash kernel (an ATen operator) or the decode kernel (`kernels/cpu_decode.py`).
FUSED_KERNEL_CPU = "a fused kernel ran on CPU"
_ATEN_FLASH_KERNEL_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"


# 2 layers, 4 query heads over 2 key/value heads (grouped-query attention); fits any decoder config class.
TINY_SIZES = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
}


def tiny_llama_config(**overrides) -> LlamaConfig:
    values = {**TINY_SIZES, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2}
    values.update(overrides)
    return LlamaConfig(**values)


# The MoE families' default expert counts (60 and 128) make a tiny model slow; four experts take the same paths.
FEWER_EXPERTS = {name: {"num_experts": 4, "num_experts_per_tok": 2} for name in ("qwen2_moe", "qwen3_moe")}


def tiny_config(model_type: str, **overrides) -> PreTrainedConfig:
    """A tiny random config of any family, with the same sizes and special tokens as `tiny_llama_config`."""
    values = {**TINY_SIZES, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2}
    values.update(FEWER_EXPERTS.get(model_type, {}))
    values.update(overrides)
    return AutoConfig.for_model(model_type, **values)


def left_padded_batch(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random prompts of the given lengths, left-padded with token 0, as generate() expects them."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(3, 256, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class _KernelCounter(TorchDispatchMode):
    """Counts the ATen operators that run below autograd, under the key each name maps to (cheap: no profiler
    events are kept)."""

    def __init__(self, counts: Counter, keys: dict[str, str]) -> None:
        super().__init__()
        self.counts, self.keys = counts, keys

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket._qualified_op_name
        if name in self.keys:
            self.counts[self.keys[name]] += 1
        return func(*args, **(kwargs or {}))


class CopiedElements(TorchDispatchMode):
    """Counts the elements every copying operator writes (cat, clone, copies, gathers, index copies), by operator."""

    WRITTEN_BY_OUTPUT = {"aten::cat", "aten::clone", "aten::index_select", "aten::_to_copy", "aten::repeat_interleave"}

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        name = func.overloadpacket._qualified_op_name
        if name in self.WRITTEN_BY_OUTPUT:
            self.counts[name] += output.numel()
        elif name == "aten::copy_":
            self.counts[name] += args[0].numel()
        elif name == "aten::index_copy_":
            self.counts[name] += args[3].numel()
        return output


def decode_step_copies(model, prompt: dict[str, torch.Tensor], step: dict[str, torch.Tensor]) -> tuple[Counter, set]:
    """Prefill `prompt` into a new `GrowingCache`, then run one decode step (`step`'s inputs) with the flag: what each
    operator of the step copied (elements), and the cache's key storages, to compare with what a kernel was given."""
    cache = GrowingCache(model.config, max_cache_len=prompt["input_ids"].shape[1] + 1)
    with torch.no_grad():
        model(**prompt, past_key_values=cache, use_cache=True, use_flash_attention=True)
        with CopiedElements() as counter:
            model(**step, past_key_values=cache, use_cache=True, use_flash_attention=True)
    return counter.counts, {layer.key_storage.untyped_storage().data_ptr() for layer in cache.layers}


# The modules that call the fused kernel dispatch: a plain call, a padded prompt or several sequences in a row, a
# window or a chunk cut into pieces.
KERNEL_CALLERS = (attention, variable_length, local_attention)


def spy_on_fused_kernel(monkeypatch: pytest.MonkeyPatch, wrap: Callable[[Callable], Callable]) -> None:
    """Replace the fused kernel dispatch (`fused_sdpa`) by `wrap(fused_sdpa)` wherever the attention calls it."""
    for module in KERNEL_CALLERS:
        monkeypatch.setattr(module, "fused_sdpa", wrap(module.fused_sdpa))


def count_context_cuts(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Count the decode calls `fused_sdpa` cuts along the context (`kernels/split_context.py`), by number of pieces."""
    cuts: Counter = Counter()
    cut = dispatch.split_context_sdpa

    def counted(*args, splits: int, **kwargs):
        cuts[splits] += 1
        return cut(*args, splits=splits, **kwargs)

    monkeypatch.setattr(dispatch, "split_context_sdpa", counted)
    return cuts


def count_decode_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Count the calls `fused_sdpa` runs on the CPU decode kernel (`kernels/cpu_decode.py`), by rows per head."""
    calls: Counter = Counter()
    attend = dispatch.cpu_decode_sdpa

    def counted(query, *args, **kwargs):
        calls[query.shape[2]] += 1
        return attend(query, *args, **kwargs)

    monkeypatch.setattr(dispatch, "cpu_decode_sdpa", counted)
    return calls


@contextmanager
def count_attention_paths(monkeypatch: pytest.MonkeyPatch, profile: bool = True) -> Iterator[Counter]:
    """Count attention calls per path: "fused" (our kernel dispatch), "default" (matmul-softmax), and, with
    `profile`, FUSED_KERNEL_CPU, the fused kernels that actually ran in this thread: PyTorch's (seen by a dispatch
    mode, which costs every operation a Python call: tests that need only our dispatch counts leave it off) and the
    decode kernel."""
    counts: Counter = Counter()

    def counted(name, function):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return wrapper

    spy_on_fused_kernel(monkeypatch, lambda function: counted("fused", function))
    monkeypatch.setattr(variable_length, "flex_sdpa", counted("fused", variable_length.flex_sdpa))
    monkeypatch.setattr(attention, "matmul_softmax_attention", counted("default", attention.matmul_softmax_attention))
    # Latent attention's steps over its compressed cache (`kernels/latent.py`)
    monkeypatch.setattr(attention, "absorbed_latent_sdpa", counted("fused", attention.absorbed_latent_sdpa))
    paged = paged_attention.paged_decode_sdpa  # a continuous-batching step's decode rows, over its paged cache
    monkeypatch.setattr(paged_attention, "paged_decode_sdpa", counted("fused", paged))
    if not profile:
        yield counts
        return
    counts[FUSED_KERNEL_CPU] = 0
    monkeypatch.setattr(dispatch, "cpu_decode_sdpa", counted(FUSED_KERNEL_CPU, dispatch.cpu_decode_sdpa))
    monkeypatch.setattr(paged_attention, "paged_decode_sdpa", counted(FUSED_KERNEL_CPU, counted("fused", paged)))
    with _KernelCounter(counts, {_ATEN_FLASH_KERNEL_CPU: FUSED_KERNEL_CPU}):
        yield counts


def query_sizes(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, dim: int) -> list[int]:
    """Spy on the kernel `owner.<name>(query, ...)`: each call's `query.shape[dim]`, recorded as the calls run."""
    sizes: list[int] = []
    kernel = getattr(owner, name)

    def recorded(query, *args, **kwargs):
        sizes.append(query.shape[dim])
        return kernel(query, *args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return sizes


def record_absorbed_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The query rows of each latent-attention call that attends over its compressed cache (`kernels/latent.py`)."""
    return query_sizes(monkeypatch, attention, "absorbed_latent_sdpa", 2)


def once_per_session(tmp_path_factory, name: str, produce: Callable[[Path], Any]) -> Any:
    """`produce(folder)`, run once per test session and shared as JSON by the pytest-xdist workers.

    pytest-xdist's documented recipe for expensive fixtures: without it, each worker that gets one of the tests
    would run the same expensive step again.
    """
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return produce(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent  # the session's folder, above every worker's own
    result = shared / f"{name}.json"
    with FileLock(f"{result}.lock"):
        if not result.is_file():
            folder = shared / name
            folder.mkdir()
            result.write_text(json.dumps(produce(folder)))
        return json.loads(result.read_text())


def embedded_model(tmp_path_factory) -> tuple[Path, ResolvedModel]:
    """The embedded SmolLM2 converted once per session (about 20 s) into a cache folder of its own: that folder,
    and the first resolution (`converted` is True: it did the conversion)."""

    def produce(folder: Path) -> dict[str, Any]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(CACHE_ENV_VAR, str(folder))
            resolved = resolve_model(None)
        return {"cache": str(folder), **{**resolved.__dict__, "path": str(resolved.path)}}

    record = once_per_session(tmp_path_factory, "embedded_model", produce)
    cache = Path(record.pop("cache"))
    return cache, ResolvedModel(**{**record, "path": Path(record["path"])})


# ---------------------------------------------------------------------------------------------------------------
# The example scripts, and the checkpoints and files they are given

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Flash attention computes exact attention without the full score matrix.",
    "Gaudi is an accelerator for deep learning training and inference.",
    "Once upon a time there was a tiny language model.",
]


def load_script(relative_path: str) -> ModuleType:
    """An example script (`examples/...`) as a module, for calling its main(argv) in this process."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_tiny_tokenizer(chat_template: bool) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few sentences: any text tokenizes, nothing is downloaded."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],  # ids 0, 1, 2: tiny_llama_config's pad, bos and eos
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TOKENIZER_SENTENCES, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    if chat_template:
        fast.chat_template = (
            "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}"
        )
    return fast


def save_tiny_checkpoint(
    folder: Path, chat_template: bool = True, model_type: str = "llama", max_position_embeddings: int = 128
) -> Path:
    """A stock checkpoint of `model_type`, as a user would pass it, with a tokenizer beside it."""
    tokenizer = train_tiny_tokenizer(chat_template)
    torch.manual_seed(0)
    config = tiny_config(model_type, vocab_size=len(tokenizer), max_position_embeddings=max_position_embeddings)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def free_port() -> int:
    """A port free a moment ago (for a launcher or server that takes no port 0; another process may take it first)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_gguf(path: Path, arch: str) -> Path:
    """A tiny GGUF file: metadata and one tensor, enough for the architecture check.

    The file name goes into the metadata, so that files with different names have different cache keys.
    """
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_name(path.stem)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------------------------
# Every family: the Gaudi model next to the stock one

# The 14 families with written classes: the features tested in depth (tests/core, the scripts) run over these; every
# other qualifying family is held to the contract in tests/families/.
FAMILIES = tuple(GAUDI_CAUSAL_LM_CLASSES)


def in_make_test(values, kept) -> list:
    """`values` as parameters, those not in `kept` under the `families` marker: `make test` runs the kept ones (a
    representative of each code path), `make test-families` the rest (CI runs both)."""
    return [pytest.param(value, marks=() if value in kept else pytest.mark.families) for value in values]


# Gemma 2 soft-caps its attention logits, which no fused kernel computes: those calls take the default path.
SOFT_CAPPED = {"gemma2"}


def build_pair(model_type: str, **overrides):
    """The Gaudi model and the stock eager model of a family, with the same random weights."""
    model_class = gaudi_model_class(model_type)
    stock_class = model_class.__bases__[-1]
    torch.manual_seed(0)
    config = tiny_config(model_type, initializer_range=0.1, **overrides)
    ours = model_class(config).eval()
    stock = stock_class(tiny_config(model_type, attn_implementation="eager", **overrides)).eval()
    stock.load_state_dict(ours.state_dict())
    assert stock.config._attn_implementation == "eager"
    return ours, stock


# Each family's sliding-window settings, with a window shorter than the tests' prompts.
SLIDING_WINDOW_CONFIGS = {
    "mistral": {"sliding_window": 5},
    "qwen2": {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    "qwen3": {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    "gemma2": {"sliding_window": 5, "attn_logit_softcapping": None},
    "gemma3_text": {"sliding_window": 5, "sliding_window_pattern": 2},
    "phi3": {"sliding_window": 5},
    "starcoder2": {"sliding_window": 5},
}
