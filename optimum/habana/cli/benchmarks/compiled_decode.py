"""benchmark_compiled_decode.py's measurements: generate() with a static cache and transformers' own compile of the
decode step, this library's flag against stock transformers' SDPA, side by side in one process; and the read
bandwidth that bounds a batch-1 decode step.

Both models hold the same weights and run the same prompts, cache, compile config and seed; their runs alternate,
so that a change of machine load hits both. Decode throughput excludes the prompt: (new tokens - 1) x batch over the
time from the first token to the last, per run, median of the measured runs.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import CompileConfig, GenerationConfig, PreTrainedModel

from optimum.habana.cli.generation.generation_config import compile_config_for
from optimum.habana.cli.generation.timing import timed_generate
from optimum.habana.utils.devices import synchronize


@dataclass
class DecodeRun:
    decode_tokens_per_second: float
    first_token_seconds: float


def compile_config(device: torch.device, backend: str) -> CompileConfig:
    """run_generation.py's compile config, held to one graph per shape (a break fails the benchmark)."""
    config = compile_config_for(device, backend)
    config.fullgraph, config.dynamic = True, False
    return config


def decode_run(
    model: PreTrainedModel, inputs: dict[str, torch.Tensor], generation_config: GenerationConfig
) -> DecodeRun:
    """One generate() call: decode tokens per second after the first token, and the first token's latency."""
    output, run = timed_generate(model, inputs, generation_config, inputs["input_ids"].device, seed=0)
    decode_seconds = run.seconds - run.first_token_seconds
    return DecodeRun(output.shape[0] * (run.new_tokens - 1) / decode_seconds, run.first_token_seconds)


def median_run(runs: list[DecodeRun]) -> DecodeRun:
    return DecodeRun(
        statistics.median(run.decode_tokens_per_second for run in runs),
        statistics.median(run.first_token_seconds for run in runs),
    )


def median_seconds(work: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median time of `repeats` calls of `work`, after one untimed call (first touch)."""
    work()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth_bytes_per_second(device: torch.device, gib: float = 1.0, repeats: int = 7) -> float:
    """Bytes per second that a sum over a tensor far larger than the caches reads: the bound of a step that reads
    every weight once (median of `repeats`)."""
    data = torch.ones(int(gib * 1024**3) // 4, dtype=torch.float32, device=device)
    return data.numel() * 4 / median_seconds(data.sum, device, repeats)


def weight_gemv_seconds(model: PreTrainedModel, repeats: int = 7) -> float:
    """Seconds that one batch-1 product with every linear weight takes, eagerly, each weight read once: what a decode
    step costs before attention, norms, the compiled graph's own overhead and generate()'s loop (median of `repeats`)."""
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    device = next(model.parameters()).device
    inputs = [torch.randn(1, 1, linear.in_features, device=device, dtype=linear.weight.dtype) for linear in linears]

    def products() -> None:
        for linear, vector in zip(linears, inputs, strict=True):
            torch.nn.functional.linear(vector, linear.weight)

    with torch.no_grad():
        return median_seconds(products, device, repeats)


def bytes_read_per_decode_step(model: PreTrainedModel, batch: int, cache_length: int) -> int:
    """What one decode step reads at least: every weight once, and the keys and values of its static cache (its
    attention reads the whole buffer, masked)."""
    weights = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    cache = 2 * config.num_hidden_layers * batch * config.num_key_value_heads * head_dim * cache_length * element
    return weights + cache


__all__ = [
    "DecodeRun",
    "bytes_read_per_decode_step",
    "compile_config",
    "decode_run",
    "median_run",
    "read_bandwidth_bytes_per_second",
    "weight_gemv_seconds",
]
