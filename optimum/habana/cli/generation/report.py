"""What run_generation.py prints and writes: the texts, the stats block in Optimum-Habana's wording, and results.json
(Optimum-Habana's top-level keys, then everything this run was made of), written atomically.
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import (
    CompileConfig,
    PreTrainedTokenizerBase,
)

from optimum.habana.cli.common import environment_versions
from optimum.habana.transformers.generation import GaudiGenerationConfig
from optimum.habana.utils.atomic import atomic_write_text, atomic_write_text_beside

from .arguments import RESULTS_FILENAME, ScriptArguments


GB = 1024**3


def optimum_habana_results(stats: dict[str, Any], prompts: Sequence[str], texts: Sequence[str]) -> dict[str, Any]:
    """results.json's top-level keys as Optimum-Habana writes them, same meaning and units: throughput in tokens
    per second, latencies in seconds, `input` the prompts and `output` one list per prompt of its full text."""
    return {
        "throughput": stats["throughput_tokens_per_second"],
        "avg_first_token_latency": stats["avg_first_token_latency_seconds"],
        "avg_rest_token_latency": stats["avg_rest_token_latency_seconds"],
        "avg_e2e_latency": stats["avg_e2e_latency_seconds"],
        "input": list(prompts),
        "output": [[text] for text in texts],
    }


def results_document(
    arguments: ScriptArguments,
    stats: dict[str, Any],
    prompts: Sequence[str],
    full_texts: Sequence[str],
    texts: list[dict[str, Any]],
    *,
    device: torch.device,
    generation_config: GaudiGenerationConfig,
    **details: Any,
) -> dict[str, Any]:
    """results.json: Optimum-Habana's top-level keys, then what the run was made of (`details`: dtype, model...) and
    its texts and stats. `stats` carries the Optimum-Habana averages, whichever way the run generated."""
    return {
        **optimum_habana_results(stats, prompts, full_texts),
        "arguments": arguments.as_dict(),
        "versions": environment_versions(),
        "device": device.type,
        **details,
        "generation_config": generation_config_summary(generation_config),
        "texts": texts,
        "stats": stats,
    }


def decode_new_tokens(tokenizer: PreTrainedTokenizerBase, output: torch.Tensor, input_length: int) -> list[str]:
    return tokenizer.batch_decode(output[:, input_length:].cpu(), skip_special_tokens=True)


def generation_config_summary(config: GaudiGenerationConfig) -> dict[str, Any]:
    """The values that are set, for the JSON report."""
    values = {name: value for name, value in config.to_dict().items() if value is not None}
    if isinstance(values.get("compile_config"), CompileConfig):
        values["compile_config"] = values["compile_config"].to_dict()
    return values


def format_header(description: str, device: torch.device, dtype: torch.dtype, arguments: ScriptArguments) -> str:
    workload, execution = arguments.workload, arguments.execution
    if arguments.attention.use_flash_attention:
        attention = "fused kernel (--use_flash_attention)"
    else:
        attention = "default (matmul-softmax)"
    if workload.num_beams > 1:
        search = f"beam search ({workload.num_beams} beams{', sampling' if workload.do_sample else ''})"
    else:
        search = "sampling" if workload.do_sample else "greedy"
    return "\n".join(
        [
            f"Model: {description}",
            f"Device: {device.type}, dtype: {str(dtype).removeprefix('torch.')}, attention: {attention}",
            f"Workload: batch {workload.batch_size}, up to {workload.max_new_tokens} new tokens, {search}; "
            f"{execution.warmup} warm-up + {execution.n_iterations} measured runs",
        ]
    )


def format_texts(prompts: Sequence[str], texts: Sequence[str]) -> str:
    """One block per sequence of the batch."""
    blocks = []
    for index, (prompt, text) in enumerate(zip(prompts, texts, strict=True), start=1):
        blocks.append(f"--- [{index}/{len(prompts)}] ---\nPrompt: {prompt}\nOutput: {text.strip()}")
    return "\n".join(blocks)


def format_stats(stats: dict[str, Any], device: torch.device) -> str:
    """The stats block, in Optimum-Habana's wording; on CPU memory is the process's resident memory."""
    rows = [
        ("Input tokens", f"{stats['input_tokens']}"),
        (
            f"Throughput (median of {len(stats['runs'])} runs)",
            f"{stats['throughput_tokens_per_second']:.2f} tokens/second "
            f"({stats['batch_size']} x {stats['new_tokens']} new tokens in {stats['generation_seconds']:.3f} s)",
        ),
        ("Average first token latency", f"{stats['avg_first_token_latency_seconds'] * 1000:.1f} ms"),
    ]
    if stats["avg_rest_token_latency_seconds"] is not None:
        rows.append(("Average rest token latency", f"{stats['avg_rest_token_latency_seconds'] * 1000:.1f} ms"))
    rows.append(("Average end to end latency", f"{stats['avg_e2e_latency_seconds'] * 1000:.1f} ms"))
    allocated = format_bytes(stats["memory_allocated_bytes"])
    peak = format_bytes(stats["max_memory_allocated_bytes"])
    if device.type == "cpu":
        allocated += " (process resident memory)"
        peak += " (peak resident memory since the model was loaded)"
    rows += [("Memory allocated", allocated), ("Max memory allocated", peak)]
    if stats.get("total_memory_bytes") is not None:
        total = format_bytes(stats["total_memory_bytes"])
        rows.append(("Total memory available", total + (" (system memory)" if device.type == "cpu" else "")))
    parameters = f"{stats['num_parameters'] / 1e6:.1f}M parameters"
    rows.append(("Model size", f"{format_bytes(stats['model_size_bytes'])} ({parameters})"))
    load = f"{stats['model_load_seconds']:.2f} s"
    if stats["gguf_converted"]:
        load += " (includes the one-time GGUF conversion)"
    rows.append(("Model load time", load))
    if stats["compile_seconds"] is not None:
        rows.append(("Graph compilation duration", f"{stats['compile_seconds']:.2f} seconds (the warm-up runs)"))
    width = max(len(label) for label, _ in rows)
    rule = "-" * 100
    return "\n".join(["Stats:", rule, *(f"{label:<{width}} = {value}" for label, value in rows), rule])


def format_bytes(count: int) -> str:
    """Binary units, as every script here reports memory (GiB = 1024³ bytes)."""
    return f"{count / GB:.2f} GiB" if count >= GB / 10 else f"{count / 1024**2:.1f} MiB"


def write_results(output_dir: str | Path, results: dict[str, Any], overwrite: bool = False) -> Path:
    """`results.json` in `output_dir`, written atomically: a killed run leaves the earlier file (or none). Without
    `overwrite`, one that appeared during the run (another run's, into the same folder) is kept, and these results
    take the first free name beside it (`results-1.json`); the caller says where they went."""
    path, text = Path(output_dir) / RESULTS_FILENAME, json.dumps(results, indent=2, default=str) + "\n"
    return atomic_write_text(path, text) if overwrite else atomic_write_text_beside(path, text)
