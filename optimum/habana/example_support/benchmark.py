"""The default-vs-flash benchmark behind `examples/text-generation/benchmark_flash_attention.py`.

For every row of the grid (model x batch size x input tokens x new tokens) each path runs in a fresh process
(`benchmark_worker`), so each peak memory belongs to one run; the paths of a row run one after the other, in an
order that alternates from row to row, so a drifting machine affects them alike. Every figure a ratio is made of
comes from the same run of this script.
"""

import difflib
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from tqdm import tqdm
from transformers import AutoConfig, HfArgumentParser

from ..utils.devices import DEVICE_CHOICES, default_dtype, resolve_device
from ..utils.model_loading import DEFAULT_MODEL_NAME, ModelResolutionError
from .benchmark_models import PRESETS, ModelSpec, checkpoint_path
from .benchmark_report import (
    GB,
    PLOT_FILE,
    RESULT_FILES,
    failed_runs,
    kernel_table,
    markdown_table,
    meminfo_bytes,
    table_rows,
    write_results,
)
from .benchmark_worker import RESULT_MARKER
from .outputs import OutputDirError, writable_folder


# Llama-2-7B's attention, the geometry of the kernel report.
KERNEL_HEADS, KERNEL_HEAD_DIM = 32, 128


@dataclass
class BenchmarkArguments:
    model_name_or_path: list[str] = field(
        default_factory=lambda: [DEFAULT_MODEL_NAME],
        metadata={
            "nargs": "+",
            "help": f"Models, one row group each: anything run_generation.py accepts (checkpoint folder, hub id, "
            f".gguf; {DEFAULT_MODEL_NAME} is the embedded default) or a synthetic preset: "
            f"{', '.join(PRESETS)} (real attention geometry, random weights, --preset_layers layers, reduced MLP).",
        },
    )
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8], metadata={"nargs": "+", "help": "Batch sizes."})
    max_input_tokens: list[int] = field(
        default_factory=lambda: [16, 512], metadata={"nargs": "+", "help": "Prompt lengths in tokens (random ids)."}
    )
    max_new_tokens: list[int] = field(
        default_factory=lambda: [16, 64],
        metadata={"nargs": "+", "help": "Tokens generated per sequence (EOS suppressed: always exactly this many)."},
    )
    ragged: bool = field(
        default=False,
        metadata={"help": "Every second row of a batch a quarter shorter, left-padded: the padded-batch case."},
    )
    flash_attention_causal_mask: bool = field(
        default=False, metadata={"help": "Run the flash path with --flash_attention_causal_mask."}
    )
    compare_transformers: bool = field(
        default=False,
        metadata={
            "aliases": ["--compare-transformers"],
            "help": "Also run stock transformers (attn_implementation 'eager' and 'sdpa') on every row.",
        },
    )
    floor: bool = field(
        default=True,
        metadata={
            "help": "Also measure the floor: the same model with attention replaced by a pass-through of V, no mask "
            "(one run per row). --no_floor skips it."
        },
    )
    preset_layers: int = field(default=1, metadata={"help": "Decoder layers of the synthetic presets."})
    preset_intermediate_size: int = field(default=2048, metadata={"help": "MLP width of the synthetic presets."})
    device: str = field(default="auto", metadata={"choices": DEVICE_CHOICES, "help": "auto: HPU, CUDA, then CPU."})
    bf16: bool | None = field(
        default=None,
        metadata={
            "nargs": "?",
            "const": True,
            "help": "bf16 (--bf16) or fp32 (--bf16 False); default: bf16 on HPU and CUDA, fp32 on CPU.",
        },
    )
    warmup: int = field(default=1, metadata={"help": "Untimed generate() calls per path and row."})
    n_iterations: int = field(default=3, metadata={"help": "Measured calls per path and row; the median is reported."})
    threads: int | None = field(
        default=None,
        metadata={
            "help": "Torch threads per measuring process (default: torch's, all cores). On a shared machine 1 "
            "is steadier: two spinning threads wait for each other whenever another process takes a core."
        },
    )
    timeout: float = field(default=900.0, metadata={"help": "Seconds per process (load + runs); past it: timeout."})
    memory_limit_gb: float | None = field(
        default=None,
        metadata={
            "help": "CPU: how much a measuring process may allocate before its allocations fail (OOM in the "
            "table). Default: 80%% of the memory available at start. 0: no cap."
        },
    )
    attention_kernel_report: bool = field(
        default=False,
        metadata={
            "help": "Also report the flash path's attention-only FLOP rate (Llama-2-7B attention, "
            "--kernel_tokens tokens) next to the measured GEMM rate."
        },
    )
    kernel_tokens: int = field(default=4096, metadata={"help": "Sequence length of the kernel report."})
    seed: int = field(default=0, metadata={"help": "Seed of the prompts and of the presets' weights."})
    output_dir: str | None = field(
        default=None, metadata={"help": f"Write {' and '.join(RESULT_FILES)} (and the plot) there."}
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace results already in --output_dir."})
    plot: bool = field(
        default=False, metadata={"help": f"Plot memory and throughput against input length to OUTPUT_DIR/{PLOT_FILE}."}
    )


@dataclass(frozen=True)
class Row:
    model: ModelSpec
    batch_size: int
    input_tokens: int
    new_tokens: int


def build_parser() -> HfArgumentParser:
    return HfArgumentParser(
        [BenchmarkArguments],
        prog="benchmark_flash_attention.py",
        description="Throughput, prefill time and peak memory with and without --use_flash_attention, over a grid.",
    )


def usage_error(parser: HfArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def parse_arguments(parser: HfArgumentParser, argv: Sequence[str] | None) -> BenchmarkArguments:
    (arguments,) = parser.parse_args_into_dataclasses(args=None if argv is None else list(argv))
    try:
        validate_arguments(arguments)
    except ValueError as error:
        usage_error(parser, str(error))
    return arguments


def validate_arguments(arguments: BenchmarkArguments) -> None:
    """Checks that need no model; a ValueError names the flag and what to do."""
    for name in ("batch_sizes", "max_input_tokens", "max_new_tokens"):
        bad = [value for value in getattr(arguments, name) if value < 1]
        if bad:
            raise ValueError(f"--{name} takes positive integers, got {bad}.")
    if arguments.threads is not None and arguments.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {arguments.threads}.")
    for name in ("preset_layers", "preset_intermediate_size", "n_iterations", "kernel_tokens"):
        if getattr(arguments, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(arguments, name)}.")
    if arguments.warmup < 0:
        raise ValueError(f"--warmup must be 0 or more, got {arguments.warmup}.")
    if arguments.timeout <= 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {arguments.timeout}.")
    if arguments.memory_limit_gb is not None and arguments.memory_limit_gb < 0:
        raise ValueError(f"--memory_limit_gb must be 0 (no cap) or more, got {arguments.memory_limit_gb}.")
    if arguments.plot and not arguments.output_dir:
        raise ValueError("--plot writes a PNG into --output_dir: give --output_dir too.")
    if arguments.output_dir and not arguments.overwrite:
        existing = [name for name in (*RESULT_FILES, PLOT_FILE) if (Path(arguments.output_dir) / name).exists()]
        if existing:
            raise ValueError(
                f"--output_dir {arguments.output_dir} already holds {', '.join(existing)}: choose another folder, "
                "or pass --overwrite to replace them."
            )


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


def resolve_checkpoint(name: str) -> Path:
    """The model's folder; a name that is no model but close to a preset (a typo) is told the presets first."""
    try:
        return checkpoint_path(name)
    except ModelResolutionError as error:
        close = difflib.get_close_matches(name, PRESETS, n=1, cutoff=0.75)
        if not close and not name.endswith("-attn"):
            raise
        guess = f"did you mean {close[0]!r}? " if close else ""
        raise ModelResolutionError(
            f"--model_name_or_path {name!r} is not a preset: {guess}The presets are {', '.join(PRESETS)}. "
            f"(As a model it could not be found: {error})"
        ) from None


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


def memory_budget_bytes(arguments: BenchmarkArguments, device: torch.device) -> int | None:
    if device.type != "cpu":
        return None  # the device allocator fails cleanly on its own
    if arguments.memory_limit_gb is not None:
        return int(arguments.memory_limit_gb * GB) or None
    available = meminfo_bytes("MemAvailable")
    return int(available * 0.8) if available else None


def run_worker(
    task: dict[str, Any], timeout: float, worker: str = "optimum.habana.example_support.benchmark_worker"
) -> dict[str, Any]:
    """One measurement in a fresh process of the `worker` module: its result, or a timeout / OOM / error status."""
    command = [sys.executable, "-m", worker, json.dumps(task)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"still running after --timeout {timeout:g} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    if done.returncode == -9:
        return {"status": "oom", "error": "killed by SIGKILL (the kernel's OOM killer)"}
    lines = done.stderr.strip().splitlines()
    return {"status": "error", "error": lines[-1] if lines else f"exit code {done.returncode}"}


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


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


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
    budget = memory_budget_bytes(arguments, device)
    rows = grid(specs, arguments)
    print(
        f"Device: {device.type}, dtype: {str(dtype).removeprefix('torch.')}; {arguments.warmup} warm-up + "
        f"{arguments.n_iterations} measured generate() per path, median; each path of a row in a fresh process"
        + (f"; {arguments.threads} torch thread(s) each" if arguments.threads else "")
        + (f"; CPU allocation cap {budget / GB:.1f} GB per process" if budget else ""),
        flush=True,
    )
    total = sum(len(paths_for(arguments, index)) for index in range(len(rows))) + arguments.attention_kernel_report
    progress = tqdm(total=total, unit="run", desc="benchmark", file=sys.stderr, disable=None)
    records = []
    for index, row in enumerate(rows):
        results = {}
        for path in paths_for(arguments, index):
            progress.set_postfix_str(f"BS {row.batch_size}, in {row.input_tokens}, new {row.new_tokens}: {path}")
            results[path] = run_worker(row_task(row, path, arguments, device, dtype, budget), arguments.timeout)
            progress.update()
        records.append(summarize_row(row, results))
        if output_dir:  # rows so far, so that an interrupted grid still leaves its measurements
            write_results(output_dir, arguments, device, dtype, records, None, complete=False)
    kernel = None
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
        kernel = run_worker(kernel_task, arguments.timeout)
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
