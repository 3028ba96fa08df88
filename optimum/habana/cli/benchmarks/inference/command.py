"""The default-vs-flash benchmark behind `examples/text-generation/benchmark_flash_attention.py`: the grid and its run.

For every row of the grid (model x batch size x input tokens x new tokens) each path runs in a fresh process
(`worker`), so each peak memory belongs to one run; the paths of a row run one after the other, in an
order that alternates from row to row, so a drifting machine affects them alike. Every figure a ratio is made of
comes from the same run of this script.
"""

import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoConfig, HfArgumentParser

from optimum.habana.cli.benchmarks.models import PRESETS, ModelSpec, resolve_checkpoint
from optimum.habana.cli.benchmarks.tables import GB, kept, markdown_table
from optimum.habana.cli.benchmarks.workers import memory_budget_bytes, ratio, run_worker
from optimum.habana.cli.common import OutputDirError, exit_on_interrupt_or_oom, writable_folder
from optimum.habana.utils.devices import default_dtype, resolve_device
from optimum.habana.utils.model_loading import ModelResolutionError

from .arguments import BenchmarkArguments, usage_error
from .report import failed_runs, kernel_table, table_rows, write_results


WORKER = "optimum.habana.cli.benchmarks.inference.worker"
# Llama-2-7B's attention, the geometry of the kernel report.
KERNEL_HEADS, KERNEL_HEAD_DIM = 32, 128


@dataclass(frozen=True)
class Row:
    model: ModelSpec
    batch_size: int
    input_tokens: int
    new_tokens: int


def check_models(arguments: BenchmarkArguments) -> list[ModelSpec]:
    """Resolve every model once here (a GGUF is converted once, then cached for the workers); a bad one is an error."""
    specs = []
    longest = max(arguments.max_input_tokens) + max(arguments.max_new_tokens)
    for name in arguments.model_name_or_path:
        spec = ModelSpec(name, arguments.preset_layers, arguments.preset_intermediate_size)
        if not spec.is_preset:
            positions = getattr(AutoConfig.from_pretrained(resolve_checkpoint(name)), "max_position_embeddings", None)
            if positions is not None and longest > positions:
                raise ValueError(
                    f"--model_name_or_path {name}: --max_input_tokens + --max_new_tokens reaches {longest} tokens, "
                    f"beyond its {positions} positions. Lower them, or use a preset ({', '.join(PRESETS)})."
                )
        specs.append(spec)
    return specs


def grid(specs: Sequence[ModelSpec], arguments: BenchmarkArguments) -> list[Row]:
    return [
        Row(spec, batch, tokens, new)
        for spec in specs
        for batch in arguments.batch_sizes
        for tokens in arguments.max_input_tokens
        for new in arguments.max_new_tokens
    ]


def paths_for(arguments: BenchmarkArguments, row_index: int) -> list[str]:
    """The paths of one row, in the order they run: reversed every other row."""
    paths = ["default", "flash"]
    if arguments.compare_transformers:
        paths += ["eager", "sdpa"]
    if arguments.floor:
        paths.append("floor")
    return paths if row_index % 2 == 0 else paths[::-1]


def row_task(
    row: Row, path: str, arguments: BenchmarkArguments, device: torch.device, dtype: torch.dtype, budget: int | None
) -> dict[str, Any]:
    floor = path == "floor"
    return {
        "kind": "generate",
        "model": asdict(row.model),
        "path": path,
        "batch_size": row.batch_size,
        "input_tokens": row.input_tokens,
        "new_tokens": row.new_tokens,
        "ragged": arguments.ragged,
        "causal_mask": arguments.flash_attention_causal_mask,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "seed": arguments.seed,
        # The floor is measured for its memory: one run is enough, and it costs the least.
        "warmup": 0 if floor else arguments.warmup,
        "n_iterations": 1 if floor else arguments.n_iterations,
        "memory_limit_bytes": budget,
        "threads": arguments.threads,
    }


def summarize_row(row: Row, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One table row: each path's raw measurement and the ratios computed from them."""

    def value(path: str, name: str) -> float | None:
        result = results.get(path, {})
        return result.get(name) if result.get("status") == "ok" else None

    default_peak, flash_peak = value("default", "peak_memory_bytes"), value("flash", "peak_memory_bytes")
    spreads = [
        (max(result["throughputs"]) - min(result["throughputs"])) / statistics.median(result["throughputs"])
        for path, result in results.items()
        if result.get("status") == "ok" and path != "floor" and len(result["throughputs"]) > 1
    ]
    return {
        "model": row.model.label,
        "batch_size": row.batch_size,
        "max_input_tokens": row.input_tokens,
        "max_new_tokens": row.new_tokens,
        "paths": results,
        "throughput_improvement": ratio(
            value("flash", "throughput_tokens_per_second"), value("default", "throughput_tokens_per_second")
        ),
        "memory_reduction_bytes": None if None in (default_peak, flash_peak) else default_peak - flash_peak,
        "flash_vs_sdpa": ratio(
            value("flash", "throughput_tokens_per_second"), value("sdpa", "throughput_tokens_per_second")
        ),
        "default_vs_eager": ratio(
            value("default", "throughput_tokens_per_second"), value("eager", "throughput_tokens_per_second")
        ),
        "flash_extra_vs_floor": ratio(value("flash", "extra_memory_bytes"), value("floor", "extra_memory_bytes")),
        "default_extra_vs_floor": ratio(value("default", "extra_memory_bytes"), value("floor", "extra_memory_bytes")),
        "noise_percent": 100 * max(spreads) if spreads else None,
    }


def run(arguments: BenchmarkArguments, parser: HfArgumentParser) -> int:
    try:
        device = resolve_device(arguments.device)
        # Before the first row: a folder that cannot take the results would lose every measurement.
        output_dir = writable_folder(arguments.output_dir) if arguments.output_dir else None
        specs = check_models(arguments)
    except (ModelResolutionError, OutputDirError, ValueError, OSError) as error:
        usage_error(parser, str(error))
    dtype = default_dtype(device) if arguments.bf16 is None else (torch.bfloat16 if arguments.bf16 else torch.float32)
    budget = memory_budget_bytes(arguments.memory_limit_gb, device)
    rows = grid(specs, arguments)
    print(
        f"Device: {device.type}, dtype: {str(dtype).removeprefix('torch.')}; {arguments.warmup} warm-up + "
        f"{arguments.n_iterations} measured generate() per path, median; each path of a row in a fresh process"
        + (f"; {arguments.threads} torch thread(s) each" if arguments.threads else "")
        + (f"; CPU allocation cap {budget / GB:.1f} GiB per process" if budget else ""),
        flush=True,
    )
    total = sum(len(paths_for(arguments, index)) for index in range(len(rows))) + arguments.attention_kernel_report
    progress = tqdm(total=total, unit="run", desc="benchmark", file=sys.stderr, disable=None)
    records, written, kernel = [], [], None
    with exit_on_interrupt_or_oom(
        parser.prog,
        on_interrupt=lambda: kept(written),
        on_out_of_memory=lambda error: f"out of memory in the benchmark's own process; {kept(written)}",
    ):
        for index, row in enumerate(rows):
            results = {}
            for path in paths_for(arguments, index):
                progress.set_postfix_str(f"BS {row.batch_size}, in {row.input_tokens}, new {row.new_tokens}: {path}")
                results[path] = run_worker(
                    row_task(row, path, arguments, device, dtype, budget), arguments.timeout, WORKER
                )
                progress.update()
            records.append(summarize_row(row, results))
            if output_dir:  # rows so far, so that an interrupted grid still leaves its measurements
                written = write_results(output_dir, arguments, device, dtype, records, None, complete=False)
        if arguments.attention_kernel_report:
            progress.set_postfix_str("attention kernel")
            kernel_task = {
                "kind": "kernel",
                "device": device.type,
                "dtype": str(dtype).removeprefix("torch."),
                "heads": KERNEL_HEADS,
                "head_dim": KERNEL_HEAD_DIM,
                "input_tokens": arguments.kernel_tokens,
                "gemm_size": 2048,
                "seed": arguments.seed,
                "warmup": 1,
                "n_iterations": 3,
                "threads": arguments.threads,
            }
            kernel = run_worker(kernel_task, arguments.timeout, WORKER)
            progress.update()
    progress.close()

    table = table_rows(records, arguments)
    print(markdown_table(table))
    for spec in specs:
        if spec.is_preset:
            print(f"\n{spec.name}: {spec.label.split(' (', 1)[1].rstrip(')')}.")
    if arguments.ragged:
        print("\nPadded batches: every second row a quarter shorter, left-padded.")
    if kernel is not None:
        print(
            f"\nAttention only, causal prefill of {arguments.kernel_tokens} tokens, {KERNEL_HEADS} heads of "
            f"{KERNEL_HEAD_DIM}:\n{kernel_table(kernel)}"
        )
    if output_dir:
        written = write_results(output_dir, arguments, device, dtype, records, kernel, complete=True)
        print(f"\nWritten: {', '.join(str(path) for path in written)}")
    failures = failed_runs(records, kernel)
    for failure in failures:
        print(f"{parser.prog}: failed: {failure}", file=sys.stderr)
    if failures:
        # OOM and timeouts are measurements (the table shows them); any other failure is a broken run.
        print(
            f"{parser.prog}: error: {len(failures)} run(s) failed for a reason other than OOM or timeout (above); "
            "their cells say 'error'.",
            file=sys.stderr,
        )
        return 1
    return 0
