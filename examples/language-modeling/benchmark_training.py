#!/usr/bin/env python
"""Long-sequence training steps (forward + backward) per attention path, against the floor and stock transformers.

    python examples/language-modeling/benchmark_training.py --model smollm2-attn --layers 4 \\
        --tokens 1024 2048 4096 --modes lora --gradient_checkpointing on --paths floor flash default sdpa \\
        --threads 1 --timed_steps 2 --output_dir outputs/training_benchmark

One row per model x tokens x padding x mode (LoRA on the attention projections, or full fine-tuning) x gradient
checkpointing; each path of a row runs in a fresh process (`training_benchmark_worker`), so each peak memory
belongs to one run, in an order that alternates from row to row. A worker builds the model in fp32, runs one
forward + backward for the memory, then `--timed_steps` more, the fastest of which is the step time; there is no
optimizer step (its state depends on the trainable weights only: the same for every path). Paths: `floor`
(attention replaced by a pass-through of V, no mask: what no attention can go below), `flash` (this library,
use_flash_attention), `default` (this library's matmul-softmax), `sdpa` and `eager` (stock transformers).

Memory is the process's resident memory (CPU): `extra` is the peak during the first step minus what was resident
before it (the built model; the step's gradients are part of the extra, alike for every path), `peak` the peak
itself. The worker fixes glibc's mmap threshold for that step so that freed tensors leave the resident set (see
`training_benchmark_worker`). Each worker's allocations are capped (`--memory_limit_gb`, default 80% of the memory
available at start, applied with RLIMIT_AS once the model is built), so a path that needs more fails with an
allocation error and its cell says OOM, instead of the kernel's OOM killer picking a process on a shared machine; a
worker killed by SIGKILL anyway is reported as OOM too. A worker past `--timeout` says timeout; any other failure
says error, and the script then exits 1 naming the row and the error.

Models: the synthetic presets (real attention geometry, random weights, `--layers` layers, MLP
`--intermediate_size`; see benchmark_models.py) and `smollm2`, the embedded SmolLM2-135M-Instruct checkpoint (30
layers: slow at long lengths on CPU; beyond its 8192 positions the step runs, only speed and memory are read).
Writes results.json, results.csv, results.md and training.png into `--output_dir`; docs/fine_tuning.md shows a table.
"""

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from transformers import AutoConfig

from optimum.habana.cli.benchmarks import workers
from optimum.habana.cli.benchmarks.models import PRESETS, ModelSpec, checkpoint_path
from optimum.habana.cli.benchmarks.tables import GB, kept
from optimum.habana.cli.benchmarks.training.report import PLOT_FILE, RESULT_FILES, markdown_report, write_results
from optimum.habana.cli.benchmarks.workers import memory_budget_bytes, ratio
from optimum.habana.cli.common import OutputDirError, check_environment, exit_on_interrupt_or_oom, writable_folder
from optimum.habana.utils.model_loading import DEFAULT_MODEL_NAME


PROG = "benchmark_training.py"
PATHS = ("floor", "flash", "default", "sdpa", "eager")
CHECKPOINT_ALIASES = {"smollm2": DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME: DEFAULT_MODEL_NAME}
WORKER = "optimum.habana.cli.benchmarks.training.worker"


@dataclass(frozen=True)
class Row:
    model: ModelSpec
    tokens: int
    batch_size: int
    padding: str  # "none", "left" or "right"
    mode: str  # "lora" or "full"
    gradient_checkpointing: bool

    @property
    def group(self) -> str:
        """Everything but the length: one line of the plot."""
        batch = f"BS {self.batch_size}" + ("" if self.padding == "none" else f" {self.padding}-padded")
        checkpointing = "GC on" if self.gradient_checkpointing else "GC off"
        return f"{short_name(self.model)}, {batch}, {self.mode}, {checkpointing}"

    @property
    def name(self) -> str:
        """How the row is named in the target lines and failure messages."""
        model, rest = self.group.split(", ", 1)
        return f"{model}, {self.tokens} tokens, {rest}"


def short_name(spec: ModelSpec) -> str:
    return spec.name if spec.is_preset else spec.name.rsplit("/", 1)[-1]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", choices=[*PRESETS, *CHECKPOINT_ALIASES], default=["smollm2-attn"])
    parser.add_argument("--layers", type=int, default=4, help="Decoder layers of the synthetic presets.")
    parser.add_argument("--intermediate_size", type=int, default=1536, help="MLP width of the synthetic presets.")
    parser.add_argument("--tokens", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument(
        "--padded",
        nargs="+",
        choices=("none", "left", "right"),
        default=["none"],
        help="Padding of the rows: 'left'/'right' make every second sequence of the batch 3/4 long, padded on "
        "that side (needs --batch_size 2 or more); 'none' keeps every sequence full. Several give several rows.",
    )
    parser.add_argument("--modes", nargs="+", choices=("lora", "full"), default=["lora", "full"])
    parser.add_argument("--gradient_checkpointing", choices=("on", "off", "both"), default="both")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument(
        "--timed_steps",
        type=int,
        default=1,
        help="Timed steps after the memory step; the fastest is the step time (steadier on a shared machine).",
    )
    parser.add_argument("--threads", type=int, default=None, help="Torch threads per worker (default: torch's).")
    parser.add_argument("--timeout", type=float, default=1800.0, help="Seconds per worker; past it: timeout.")
    parser.add_argument(
        "--memory_limit_gb",
        type=float,
        default=None,
        help="GiB a worker may allocate beyond its built model before its allocations fail (OOM in the table). "
        "Default: 80%% of the memory available at start. 0: no cap.",
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the batch and of the presets' weights.")
    parser.add_argument("--output_dir", default=None, help=f"Write {', '.join(RESULT_FILES)} and {PLOT_FILE} there.")
    parser.add_argument("--overwrite", action="store_true", help="Replace results already in --output_dir.")
    return parser


def parse_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    arguments = parser.parse_args(argv)
    check_environment(parser.prog)
    try:
        validate_arguments(arguments)
    except ValueError as error:
        usage_error(parser, str(error))
    arguments.paths = list(dict.fromkeys(arguments.paths))
    return arguments


def usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def validate_arguments(arguments: argparse.Namespace) -> None:
    """Checks that need no model; a ValueError names the flag."""
    for value in arguments.tokens:
        if value < 1:
            raise ValueError(f"--tokens must be at least 1, got {value}.")
    for name in ("layers", "intermediate_size", "batch_size", "timed_steps"):
        if getattr(arguments, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(arguments, name)}.")
    if arguments.threads is not None and arguments.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {arguments.threads}.")
    if not 0 < arguments.timeout < math.inf:
        raise ValueError(f"--timeout must be a positive number of seconds, got {arguments.timeout}.")
    if arguments.memory_limit_gb is not None and not arguments.memory_limit_gb >= 0:
        raise ValueError(f"--memory_limit_gb must be 0 (no cap) or more, got {arguments.memory_limit_gb}.")
    sides = [side for side in arguments.padded if side != "none"]
    if sides and arguments.batch_size < 2:
        raise ValueError(
            f"--padded {sides[0]} needs --batch_size 2 or more (every second sequence is the shorter one), "
            f"got {arguments.batch_size}."
        )
    if sides and min(arguments.tokens) < 4:
        raise ValueError(f"--padded {sides[0]} needs --tokens of at least 4, got {min(arguments.tokens)}.")
    if arguments.output_dir and not arguments.overwrite:
        existing = [name for name in (*RESULT_FILES, PLOT_FILE) if (Path(arguments.output_dir) / name).exists()]
        if existing:
            raise ValueError(
                f"--output_dir {arguments.output_dir} already holds {', '.join(existing)}: choose another folder, "
                "or pass --overwrite to replace them."
            )


def model_specs(arguments: argparse.Namespace) -> list[ModelSpec]:
    names = dict.fromkeys(CHECKPOINT_ALIASES.get(name, name) for name in arguments.model)
    return [ModelSpec(name, arguments.layers, arguments.intermediate_size) for name in names]


def grid(specs: Sequence[ModelSpec], arguments: argparse.Namespace) -> list[Row]:
    checkpointing = {"on": [True], "off": [False], "both": [True, False]}[arguments.gradient_checkpointing]
    return [
        Row(spec, tokens, arguments.batch_size, padding, mode, gc)
        for spec in specs
        for padding in dict.fromkeys(arguments.padded)
        for mode in dict.fromkeys(arguments.modes)
        for gc in checkpointing
        for tokens in sorted(set(arguments.tokens))
    ]


def run_worker(task: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One measurement in a fresh process: its result, or a timeout / OOM / error status."""
    return workers.run_worker(task, timeout, worker=WORKER)


def row_task(row: Row, path: str, arguments: argparse.Namespace, budget: int | None) -> dict[str, Any]:
    return {
        **asdict(row),
        "path": path,
        "seed": arguments.seed,
        "timed_steps": arguments.timed_steps,
        "threads": arguments.threads,
        "memory_limit_bytes": budget,
    }


def summarize_row(row: Row, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A row's raw measurements per path and the ratios made of them."""

    def value(path: str, name: str) -> float | None:
        result = results.get(path, {})
        return result.get(name) if result.get("status") == "ok" else None

    return {
        "row": row.name,
        "group": row.group,
        "model": row.model.label,
        "model_name": short_name(row.model),
        "tokens": row.tokens,
        "batch_size": row.batch_size,
        "padding": row.padding,
        "mode": row.mode,
        "gradient_checkpointing": row.gradient_checkpointing,
        "paths": results,
        "extra_vs_floor": {
            path: ratio(value(path, "extra_memory_bytes"), value("floor", "extra_memory_bytes")) for path in results
        },
        "step_vs_floor": {
            path: ratio(value(path, "step_seconds"), value("floor", "step_seconds")) for path in results
        },
        "flash_step_vs_sdpa": ratio(value("flash", "step_seconds"), value("sdpa", "step_seconds")),
    }


def beyond_positions(specs: Sequence[ModelSpec], tokens: int) -> list[str]:
    """Checkpoints whose trained positions the longest row exceeds (the step runs; said so, not refused)."""
    notes = []
    for spec in specs:
        if not spec.is_preset:
            positions = getattr(
                AutoConfig.from_pretrained(checkpoint_path(spec.name)), "max_position_embeddings", None
            )
            if positions is not None and tokens > positions:
                notes.append(
                    f"{short_name(spec)}: rows beyond its {positions} positions measure speed and memory only."
                )
    return notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arguments = parse_arguments(parser, argv)
    specs = model_specs(arguments)
    try:
        # Before the first row: a folder that cannot take the results would lose every measurement.
        output_dir = writable_folder(arguments.output_dir) if arguments.output_dir else None
        notes = beyond_positions(specs, max(arguments.tokens))
    except (OutputDirError, OSError) as error:
        usage_error(parser, str(error))
    budget = memory_budget_bytes(arguments.memory_limit_gb, torch.device("cpu"))
    header = (
        "Device: cpu, fp32; one forward + backward for the memory, then the fastest of "
        f"{arguments.timed_steps} timed; no optimizer step; each path of a row in a fresh process"
        + (f"; {arguments.threads} torch thread(s) each" if arguments.threads else "")
        + (f"; allocation cap {budget / GB:.1f} GiB per process" if budget else "; no allocation cap")
        + "."
    )
    notes += [f"{spec.name}: {spec.label.split(' (', 1)[1].rstrip(')')}." for spec in specs if spec.is_preset]
    print(header, flush=True)
    rows, records, written = grid(specs, arguments), [], []
    total, done = len(rows) * len(arguments.paths), 0
    with exit_on_interrupt_or_oom(
        PROG,
        on_interrupt=lambda: kept(written),
        on_out_of_memory=lambda error: f"out of memory in the benchmark's own process; {kept(written)}",
    ):
        for index, row in enumerate(rows):
            results = {}
            for path in arguments.paths if index % 2 == 0 else arguments.paths[::-1]:
                results[path] = result = run_worker(row_task(row, path, arguments, budget), arguments.timeout)
                done += 1
                said = f"{result['step_seconds']:.2f} s" if result["status"] == "ok" else result["status"]
                print(f"[{done}/{total}] {row.name}: {path}: {said}", file=sys.stderr, flush=True)
            records.append(summarize_row(row, {path: results[path] for path in arguments.paths}))
            if output_dir:  # rows so far, so that an interrupted grid still leaves its measurements
                written = write_results(output_dir, arguments, header, notes, records, complete=False)
    print("\n" + markdown_report(records, arguments.paths, notes), end="")
    if output_dir:
        written = write_results(output_dir, arguments, header, notes, records, complete=True)
        print(f"\nWritten: {', '.join(str(path) for path in written)}")
    failures = [
        f"{record['row']}, {path} path: {result['error']}"
        for record in records
        for path, result in record["paths"].items()
        if result["status"] not in ("ok", "oom", "timeout")
    ]
    for failure in failures:
        print(f"{PROG}: failed: {failure}", file=sys.stderr)
    if failures:
        # OOM and timeouts are measurements (the table shows them); any other failure is a broken run.
        print(
            f"{PROG}: error: {len(failures)} run(s) failed for a reason other than OOM or timeout (above).",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
