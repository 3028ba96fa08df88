"""The continuous-batching paged cache sized to the work, and the start-up line that says what it holds.

transformers sizes the paged cache from the memory it finds free on the device (60-90% of it), as on a GPU that
serves nothing else: on a CPU that is the machine's RAM (a server of a 2-layer tiny Llama held 14 GiB). On CPU,
unless `--cb-num-blocks` or `--cb-max-memory-percent` says otherwise, the cache here holds `CPU_SEQUENCES` whole
contexts of the served model, at most `CPU_CACHE_BUDGET_GIB` (vLLM's CPU backend takes a fixed budget too,
`VLLM_CPU_KVCACHE_SPACE`), and a batch takes at most `CPU_BATCH_TOKENS` tokens unless `--cb-max-batch-tokens` says
otherwise. On an accelerator transformers' sizing stays.
"""

import logging
import math
import time
from typing import Any


logger = logging.getLogger(__name__)


CPU_SEQUENCES = 8
CPU_CACHE_BUDGET_GIB = 4
CPU_BATCH_TOKENS = 512
DEFAULT_PAGE_SIZE = 256  # transformers' ContinuousBatchingConfig.page_size
BUILD_TIMEOUT_S = 300


def bytes_per_token(model: Any) -> int:
    """Key and value bytes of one token in every layer (what one cached token costs)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = next(model.parameters()).dtype
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def sized_for_cpu(options: dict[str, Any], model: Any, context: int | None) -> dict[str, Any]:
    """The `ContinuousBatchingConfig` options of a CPU server: the given ones, and a cache sized to the work."""
    if model.device.type != "cpu" or "num_blocks" in options or "max_memory_percent" in options:
        return options
    sized = dict(options)
    page = sized.get("page_size", DEFAULT_PAGE_SIZE)
    wanted = CPU_SEQUENCES * (context or 4096)
    budget = CPU_CACHE_BUDGET_GIB * 1024**3 // (page * bytes_per_token(model))
    sized["num_blocks"] = max(1, min(math.ceil(wanted / page), budget))
    sized.setdefault("max_batch_tokens", min(CPU_BATCH_TOKENS, sized["num_blocks"] * page))
    return sized


def wait_for_cache(manager: Any, timeout_s: float = BUILD_TIMEOUT_S) -> None:
    """Until the engine's worker built its paged cache (bounded); a CBWorkerDeadError saying why it could not."""
    from transformers.cli.serving.utils import CBWorkerDeadError

    engine = manager._cb
    deadline = time.monotonic() + timeout_s
    while getattr(engine, "batch_processor", None) is None:
        error = engine.background_thread_status.fatal_error
        if error is not None:
            raise CBWorkerDeadError(
                f"The continuous-batching engine could not start: its paged KV cache could not be built "
                f"({type(error).__name__}: {error})."
            )
        if time.monotonic() > deadline:
            raise CBWorkerDeadError(
                f"The continuous-batching engine could not start: its paged KV cache was not built within {timeout_s} s."
            )
        time.sleep(0.05)


def describe_cache(manager: Any) -> str:
    """The paged cache the engine built: blocks, tokens, memory and the batch limit."""
    engine = manager._cb
    cache = engine.batch_processor.cache
    page = engine.continuous_batching_config.page_size
    memory = cache.cache_tensor.numel() * cache.cache_tensor.element_size()
    return (
        f"a paged KV cache of {cache.num_blocks} blocks of {page} tokens ({cache.num_blocks * page} tokens, "
        f"{memory / 1024**2:.1f} MiB), at most {cache.max_batch_tokens} tokens per batch step"
    )
