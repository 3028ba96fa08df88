"""What each run hands to generate(): the generation config made of the model's and the command line, and the KV
cache layout (none, dynamic, static, bucketed static; reused across runs or not).
"""

import math
from dataclasses import dataclass

import torch
import transformers
from transformers import (
    CompileConfig,
)
from transformers.cache_utils import Cache, StaticCache

from optimum.habana import hpu
from optimum.habana.transformers.cache import BucketedStaticCache, static_cache_problem
from optimum.habana.transformers.generation import GaudiGenerationConfig

from .arguments import SAMPLING_ARGUMENTS, ScriptArguments
from .capture import compile_backend


def build_generation_config(
    model_generation_config: transformers.GenerationConfig,
    arguments: ScriptArguments,
    pad_token_id: int | None,
    device: torch.device,
) -> GaudiGenerationConfig:
    """The model's generation config plus the command line: what `generate(generation_config=...)` runs.

    The five attention flags are written explicitly, off included, so the command line decides them, whatever the
    checkpoint's own generation config says.
    """
    workload, execution = arguments.workload, arguments.execution
    values = model_generation_config.to_dict()
    values.pop("compile_config", None)
    values.update(
        max_new_tokens=workload.max_new_tokens,
        do_sample=workload.do_sample,
        num_beams=workload.num_beams,
        pad_token_id=pad_token_id,
        **arguments.attention.attention_flags().as_dict(),
    )
    for name in SAMPLING_ARGUMENTS:
        if not workload.do_sample:
            values[name] = None  # the model's sampling defaults would only trigger warnings in greedy/beam search
        elif getattr(workload, name) is not None:
            values[name] = getattr(workload, name)
    if workload.ignore_eos and workload.num_beams == 1:
        # No end-of-sequence stopping criterion (None would fall back to the model's): the tokens are those of a
        # run that stops, continued.
        values["eos_token_id"] = []
    elif workload.ignore_eos:
        # Beam search needs an end-of-sequence id (transformers 5.23 fills finished beams with it): suppress it.
        values["min_new_tokens"] = workload.max_new_tokens
    layout = kv_cache_layout(arguments, device)
    values["use_cache"] = layout.kind != "none"
    if layout.kind == "static" and not layout.reused:
        values["cache_implementation"] = "static"  # compiled code and recorded graphs are only reused for one shape
    config = GaudiGenerationConfig.from_dict(values)
    if execution.torch_compile:
        config.compile_config = compile_config_for(device, compile_backend(execution, device))
    return config


@dataclass(frozen=True)
class CacheLayout:
    """The KV cache a run uses: none, dynamic, static, or bucketed static; reused across runs or not. On Gaudi its
    sliding-window and chunked layers hold the whole length too (`BucketedStaticCache`'s `full_length_windows`)."""

    kind: str
    reused: bool = False
    bucket_size: int | None = None
    preallocated: bool = False
    full_length_windows: bool = False

    def describe(self, max_cache_len: int) -> str:
        """The cache in words where the run builds it (`KVCacheSupply`), or none; `--explain` words the ones
        generate() builds itself from the cache object (`explain.keys.run_cache`)."""
        if self.kind == "none":
            return "none (--use_kv_cache False): every step recomputes the whole sequence"
        if self.kind == "dynamic":
            return "dynamic: grows by one token per step (generate()'s own cache)"
        reuse = "allocated once and reused by every run" if self.reused else "allocated by every run"
        if self.kind == "static":
            return f"static: {max_cache_len} slots (prompt + --max_new_tokens), {reuse}"
        storage = "allocated in full, sliced" if self.preallocated else "grown one bucket at a time"
        return (
            f"bucketed static: {max_cache_len} slots in buckets of {self.bucket_size} ({storage}); decode attention "
            f"reads the filled buckets only; {reuse}"
        )


def kv_cache_layout(arguments: ScriptArguments, device: torch.device) -> CacheLayout:
    workload, execution = arguments.workload, arguments.execution
    if not workload.use_kv_cache:
        return CacheLayout("none")
    on_gaudi = device.type == "hpu"
    if execution.bucket_size > 0:
        return CacheLayout(
            "bucketed",
            execution.reuse_cache,
            execution.bucket_size,
            preallocated=execution.bucket_internal,
            full_length_windows=on_gaudi,
        )
    graphs = execution.use_hpu_graphs and on_gaudi
    if execution.static_shapes or execution.torch_compile or execution.reuse_cache or graphs:
        return CacheLayout("static", execution.reuse_cache, full_length_windows=on_gaudi)
    return CacheLayout("dynamic")


def check_static_cache(arguments: ScriptArguments, layout: CacheLayout, config, device: torch.device) -> None:
    """A ValueError naming the flags that ask for a static KV cache where transformers builds none for the family
    (`StaticCache` would fail with a KeyError from inside transformers, after the model loaded)."""
    problem = static_cache_problem(config) if layout.kind in ("static", "bucketed") else None
    if problem is None:
        return
    execution = arguments.execution
    asked = {
        "--static_shapes": execution.static_shapes,
        "--torch_compile": execution.torch_compile,
        "--reuse_cache": execution.reuse_cache,
        "--bucket_size": execution.bucket_size > 0,
        "--use_hpu_graphs": execution.use_hpu_graphs and device.type == "hpu",
    }
    flags = [flag for flag, given in asked.items() if given]
    raise ValueError(
        f"{', '.join(flags)}: a static KV cache is needed, and {problem}. Run without {' or '.join(flags)}."
    )


class KVCacheSupply:
    """The cache object each run hands to generate(), or None where generate() builds its own.

    `allocations` counts the caches built, so a test sees that --reuse_cache builds one for all runs.
    """

    def __init__(self, layout: CacheLayout, model_config: transformers.PreTrainedConfig, max_cache_len: int) -> None:
        self.layout, self.model_config, self.max_cache_len = layout, model_config, max_cache_len
        self.allocations = 0
        self._cache: Cache | None = None

    def __call__(self) -> Cache | None:
        if self.layout.kind not in ("static", "bucketed") or (self.layout.kind == "static" and not self.layout.reused):
            return None
        if self._cache is not None and self.layout.reused:
            self._cache.reset()
            return self._cache
        self.allocations += 1
        if self.layout.kind == "bucketed" or self.layout.full_length_windows:
            # On Gaudi a static cache is one bucket of the whole length: transformers' rolling window layers would
            # branch on a Python count that a replayed HPU graph never advances.
            bucket_size = self.layout.bucket_size if self.layout.kind == "bucketed" else self.max_cache_len
            self._cache = BucketedStaticCache(
                self.model_config,
                self.max_cache_len,
                bucket_size,
                preallocate=self.layout.preallocated or self.layout.kind == "static",
                full_length_windows=self.layout.full_length_windows,
            )
        else:
            self._cache = StaticCache(config=self.model_config, max_cache_len=self.max_cache_len)
        return self._cache

    def allow_one_graph_per_bucket(self) -> None:
        """torch.compile recompiles once per bucket: raise dynamo's limit (8 by default) to the number of buckets."""
        if self.layout.kind == "bucketed":
            buckets = math.ceil(self.max_cache_len / self.layout.bucket_size) + 1
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, buckets)


def compile_config_for(device: torch.device, backend: str | None = None) -> CompileConfig:
    """transformers compiles the decode step itself once the cache is static; on CPU and HPU only when told to."""
    if device.type == "hpu":
        config = CompileConfig(backend=backend or hpu.COMPILE_BACKEND, mode="default")
    else:
        config = CompileConfig(backend=backend or "inductor")
    config._compile_all_devices = True  # private flag: without it generate() skips compilation on CPU and HPU
    return config
