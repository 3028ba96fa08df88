"""benchmark_compiled_decode.py's measurements: generate() with a static cache and transformers' own compile of the
decode step, this library's flag against stock transformers' SDPA, side by side in one process; and the read
bandwidth that bounds a batch-1 decode step.

Both models hold the same weights and run the same prompts, cache, compile config and seed; their runs alternate,
so that a change of machine load hits both. Decode throughput excludes the prompt: (new tokens - 1) x batch over the
time from the first token to the last, per run, median of the measured runs.
"""

import statistics
import time
from dataclasses import dataclass

import torch
from transformers import CompileConfig, GenerationConfig, LogitsProcessorList, PreTrainedModel

from optimum.habana.cli.generation.timing import FirstTokenTimer
from optimum.habana.utils.devices import synchronize


@dataclass
class DecodeRun:
    decode_tokens_per_second: float
    first_token_seconds: float


def compile_config(device: torch.device, backend: str) -> CompileConfig:
    config = CompileConfig(backend=backend, fullgraph=True, dynamic=False)
    config._compile_all_devices = True  # private: generate() compiles on CUDA/XPU only otherwise
    return config


def decode_run(
    model: PreTrainedModel, inputs: dict[str, torch.Tensor], generation_config: GenerationConfig, **flags: bool
) -> DecodeRun:
    """One generate() call: decode tokens per second after the first token, and the first token's latency."""
    device = inputs["input_ids"].device
    timer = FirstTokenTimer(device)
    torch.manual_seed(0)
    synchronize(device)
    start = time.perf_counter()
    output = model.generate(
        **inputs, generation_config=generation_config, logits_processor=LogitsProcessorList([timer]), **flags
    )
    synchronize(device)
    end = time.perf_counter()
    batch, new_tokens = output.shape[0], output.shape[1] - inputs["input_ids"].shape[1]
    return DecodeRun(batch * (new_tokens - 1) / (end - timer.time), timer.time - start)


def median_run(runs: list[DecodeRun]) -> DecodeRun:
    return DecodeRun(
        statistics.median(run.decode_tokens_per_second for run in runs),
        statistics.median(run.first_token_seconds for run in runs),
    )


def read_bandwidth_bytes_per_second(device: torch.device, gib: float = 1.0, repeats: int = 7) -> float:
    """Bytes per second that a sum over a tensor far larger than the caches reads: the bound of a step that reads
    every weight once (median of `repeats`)."""
    data = torch.ones(int(gib * 1024**3) // 4, dtype=torch.float32, device=device)
    data.sum()  # first touch
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        data.sum()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times)


def weight_gemv_seconds(model: PreTrainedModel, repeats: int = 7) -> float:
    """Seconds that one batch-1 product with every linear weight takes, eagerly, each weight read once: what a decode
    step costs before attention, norms, the compiled graph's own overhead and generate()'s loop (median of `repeats`)."""
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    device = next(model.parameters()).device
    inputs = [torch.randn(1, 1, linear.in_features, device=device, dtype=linear.weight.dtype) for linear in linears]

    def products() -> None:
        for linear, vector in zip(linears, inputs, strict=True):
            torch.nn.functional.linear(vector, linear.weight)

    times = []
    with torch.no_grad():
        products()  # first touch
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            products()
            synchronize(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


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
