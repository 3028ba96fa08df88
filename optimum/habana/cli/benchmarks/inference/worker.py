"""One default-vs-flash measurement in a fresh process, so that its peak memory belongs to it alone.

    python -m optimum.habana.cli.benchmarks.inference.worker '<json task>'

The parent (`command`) starts one per path and row and reads the result line (`benchmarks.workers`).
"""

import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from optimum.habana.cli.benchmarks.models import ModelSpec, build_model
from optimum.habana.cli.benchmarks.workers import cap_address_space, report_measurement
from optimum.habana.cli.generation.timing import timed_generate
from optimum.habana.transformers.attention import gaudi_attention_forward, matmul_softmax_attention
from optimum.habana.transformers.generation import GaudiGenerationConfig
from optimum.habana.utils.devices import memory_stats, reset_peak_memory, resolve_device, synchronize


def synthetic_batch(
    batch_size: int, input_tokens: int, ragged: bool, vocab_size: int, pad_token_id: int, seed: int
) -> dict[str, torch.Tensor]:
    """Random prompt tokens; with `ragged` every second row is a quarter shorter and left-padded."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab_size, (batch_size, input_tokens), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if ragged:
        padding = input_tokens // 4
        input_ids[1::2, :padding] = pad_token_id
        attention_mask[1::2, :padding] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def generation_config_for(model: Any, path: str, new_tokens: int, causal_mask: bool) -> GenerationConfig:
    """Greedy, exactly `new_tokens` tokens (EOS suppressed): every path does the same work."""
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else getattr(model.config, "pad_token_id", None)
    values = {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "num_beams": 1,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "pad_token_id": pad if pad is not None else 0,
        "eos_token_id": config.eos_token_id,
    }
    if path in ("default", "flash"):
        flash = path == "flash"
        return GaudiGenerationConfig(
            **values, use_flash_attention=flash, flash_attention_causal_mask=flash and causal_mask
        )
    return GenerationConfig(**values)


def measure_generation(task: dict[str, Any]) -> dict[str, Any]:
    """Build the model, run warm-up + measured generate() calls, and read time and peak memory."""
    device = resolve_device(task["device"])
    dtype = getattr(torch, task["dtype"])
    spec = ModelSpec(**task["model"])
    model = build_model(spec, task["path"], dtype, task["seed"]).to(device).eval()
    generation_config = generation_config_for(model, task["path"], task["new_tokens"], task["causal_mask"])
    inputs = synthetic_batch(
        task["batch_size"],
        task["input_tokens"],
        task["ragged"],
        model.config.vocab_size,
        generation_config.pad_token_id,
        task["seed"],
    )
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
    if device.type == "cpu" and task.get("memory_limit_bytes"):
        cap_address_space(task["memory_limit_bytes"])

    synchronize(device)
    reset_peak_memory(device)
    resident = memory_stats(device)["allocated"]
    runs = []
    with torch.inference_mode():
        for index in range(task["warmup"] + task["n_iterations"]):
            _, run = timed_generate(model, inputs, generation_config, device, task["seed"])
            if index >= task["warmup"]:
                runs.append(run)
    peak = memory_stats(device)["max_allocated"]
    throughputs = [task["batch_size"] * run.new_tokens / run.seconds for run in runs]
    return {
        "status": "ok",
        "throughput_tokens_per_second": statistics.median(throughputs),
        "throughputs": throughputs,
        "prefill_seconds": statistics.median(run.first_token_seconds for run in runs),
        "new_tokens": runs[-1].new_tokens,
        "peak_memory_bytes": peak,
        "resident_before_bytes": resident,
        "extra_memory_bytes": peak - resident,
    }


def measure_attention_kernel(task: dict[str, Any]) -> dict[str, Any]:
    """Attention-only FLOP rate at one causal prefill, next to this machine's GEMM rate (the same dtype)."""
    device = resolve_device(task["device"])
    dtype = getattr(torch, task["dtype"])
    heads, head_dim, tokens = task["heads"], task["head_dim"], task["input_tokens"]
    generator = torch.Generator().manual_seed(task["seed"])
    query, key, value = (torch.randn(1, heads, tokens, head_dim, generator=generator).to(device, dtype) for _ in "qkv")
    module = torch.nn.Module().eval()
    calls = {
        "flash": lambda: gaudi_attention_forward(module, query, key, value, None, use_flash_attention=True),
        "torch_sdpa": lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True),
        "default": lambda: matmul_softmax_attention(query, key, value, None, None),
    }
    size = task["gemm_size"]
    left, right = (torch.randn(size, size, generator=generator).to(device, dtype) for _ in "ab")
    calls["gemm"] = lambda: left @ right
    seconds = {}
    with torch.inference_mode():
        for name, call in calls.items():
            times = []
            for index in range(task["warmup"] + task["n_iterations"]):
                synchronize(device)
                start = time.perf_counter()
                call()
                synchronize(device)
                if index >= task["warmup"]:
                    times.append(time.perf_counter() - start)
            seconds[name] = statistics.median(times)
    attention_flops = 4 * tokens**2 * head_dim * heads / 2  # causal: half of QKᵀ and PV
    rates = {name: attention_flops / seconds[name] for name in ("flash", "torch_sdpa", "default")}
    rates["gemm"] = 2 * size**3 / seconds["gemm"]
    return {"status": "ok", "seconds": seconds, "flops_per_second": rates, "attention_flops": attention_flops}


def main(argv: list[str]) -> int:
    task = json.loads(argv[0])
    measure = measure_attention_kernel if task["kind"] == "kernel" else measure_generation
    return report_measurement(measure, task)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
