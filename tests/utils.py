"""Shared test helpers: tiny random Llama models and counters of which attention path ran."""

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock
from transformers import AutoConfig, LlamaConfig, PreTrainedConfig

from optimum.habana.transformers import attention, paged_attention
from optimum.habana.utils.model_loading import CACHE_ENV_VAR, ResolvedModel, resolve_model


FLASH_KERNEL_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"


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


@contextmanager
def count_attention_paths(monkeypatch: pytest.MonkeyPatch, profile: bool = True) -> Iterator[Counter]:
    """Count attention calls per path: "fused" (our kernel dispatch), "default" (matmul-softmax), and, with
    `profile`, FLASH_KERNEL_CPU, the ATen fused kernel that actually ran (read from the profiler when the block
    exits; the profiler slows every operation, so tests that need only our dispatch counts leave it off)."""
    counts: Counter = Counter()

    def counted(name, function):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(attention, "fused_sdpa", counted("fused", attention.fused_sdpa))
    monkeypatch.setattr(paged_attention, "fused_sdpa", counted("fused", paged_attention.fused_sdpa))
    monkeypatch.setattr(attention, "matmul_softmax_attention", counted("default", attention.matmul_softmax_attention))
    if not profile:
        yield counts
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        yield counts
    counts[FLASH_KERNEL_CPU] = sum(1 for event in profiler.events() if event.name == FLASH_KERNEL_CPU)


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
