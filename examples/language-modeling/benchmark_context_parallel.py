#!/usr/bin/env python
"""One long sequence's training step split over 1, 2, ... processes (context parallelism): memory per process,
tokens per second, and the longest length that trains under a memory cap.

    python examples/language-modeling/benchmark_context_parallel.py --model llama3-8b-attn --layers 2 \\
        --tokens 2048 4096 8192 --sizes 1 2 --threads 1 --memory_limit_gb 4

Each cell is one torchrun launch of `--sizes` processes over gloo (`context_parallel_worker`): the flag on, LoRA on
the attention projections, fp32, one sequence of `--tokens` tokens cut into equal parts. Memory is per process: the
largest of the processes' peak resident memory (`peak`) and of its growth during the step (`extra`, the step's
activations and gradients). Every process may grow by `--memory_limit_gb` at most during the step: beyond that its
allocations fail (OOM), and the longest trainable length of a size is the longest `--tokens` that did not.
Tokens per second count the whole sequence, all processes' parts together. The defaults are the command above without
its memory cap (docs/benchmarks.md's first table); `--sizes` must divide the preset's heads (SmolLM2's 9 split over
3 or 9, not 2). Prints the table in markdown and, with `--output_dir`, writes results.json and results.md there after
every cell (marked incomplete until the last: a killed run keeps what it measured); `--overwrite` replaces an
earlier run's.
"""

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from optimum.habana.cli.benchmarks import workers
from optimum.habana.cli.benchmarks.models import PRESETS, ModelSpec
from optimum.habana.cli.benchmarks.tables import GB, kept, markdown_file, markdown_table, number
from optimum.habana.cli.benchmarks.workers import RESULT_MARKER, ratio
from optimum.habana.cli.common import (
    OutputDirError,
    check_environment,
    environment_versions,
    exit_on_interrupt_or_oom,
    hardware,
    writable_folder,
)
from optimum.habana.utils.atomic import atomic_write_text


PROG = "benchmark_context_parallel.py"
WORKER = "optimum.habana.cli.benchmarks.training.context_parallel_worker"
RESULT_FILES = ("results.json", "results.md")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        choices=list(PRESETS),
        default="llama3-8b-attn",
        help="A synthetic preset; its attention heads must split over every --sizes.",
    )
    parser.add_argument("--layers", type=int, default=2, help="Decoder layers of the preset.")
    parser.add_argument("--intermediate_size", type=int, default=1536, help="MLP width of the preset.")
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 4096, 8192], help="Sequence lengths.")
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2], help="Processes each sequence is split over.")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per process.")
    parser.add_argument(
        "--timed_steps", type=int, default=1, help="Timed steps after the memory step (fastest); 0: memory only."
    )
    parser.add_argument("--memory_limit_gb", type=float, default=0, help="Cap on each process's step, GiB (0: none).")
    parser.add_argument("--timeout", type=float, default=1800.0, help="Seconds per launch; past it: timeout.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default=None, help=f"Write {' and '.join(RESULT_FILES)} there.")
    parser.add_argument("--overwrite", action="store_true", help="Replace results already in --output_dir.")
    return parser


def usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def check_arguments(parser: argparse.ArgumentParser, arguments: argparse.Namespace) -> None:
    """Values that need no model; one line each, before anything runs."""
    heads = PRESETS[arguments.model].num_attention_heads
    for name in ("layers", "intermediate_size", "threads"):
        if getattr(arguments, name) < 1:
            usage_error(parser, f"--{name} must be at least 1, got {getattr(arguments, name)}.")
    if arguments.timed_steps < 0:
        usage_error(parser, f"--timed_steps must be 0 (memory only) or more, got {arguments.timed_steps}.")
    for size in arguments.sizes:
        if size < 1 or heads % size:
            usage_error(parser, f"--sizes {size}: {arguments.model} has {heads} heads, which {size} must divide.")
        if any(tokens < size for tokens in arguments.tokens):
            usage_error(parser, f"--tokens: every length must be at least the largest of --sizes ({size}).")
    if not arguments.memory_limit_gb >= 0:
        usage_error(parser, f"--memory_limit_gb must be 0 (no cap) or more, got {arguments.memory_limit_gb}.")
    if not 0 < arguments.timeout < math.inf:
        usage_error(parser, f"--timeout must be a positive number of seconds, got {arguments.timeout}.")
    if arguments.output_dir and not arguments.overwrite:
        existing = [name for name in RESULT_FILES if (Path(arguments.output_dir) / name).exists()]
        if existing:
            usage_error(
                parser,
                f"--output_dir {arguments.output_dir} already holds {', '.join(existing)}: choose another folder, "
                "or pass --overwrite to replace them.",
            )


def launch(task: dict[str, Any], size: int, timeout: float) -> dict[str, Any]:
    """One torchrun launch of `size` processes; the result rank 0 (or an out-of-memory process) printed. Past
    `timeout`, torchrun and its workers are stopped together (`workers.run_command`)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={size}"]
    command += ["-m", WORKER, json.dumps(task)]
    try:
        done = workers.run_command(command, timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"still running after --timeout {timeout:g} s"}
    results = [json.loads(line[len(RESULT_MARKER) :]) for line in done.stdout.splitlines() if RESULT_MARKER in line]
    if any(result["status"] == "oom" for result in results):
        return next(result for result in results if result["status"] == "oom")
    if results:
        return results[-1]
    if done.returncode in (-9, 137):
        return {"status": "oom", "error": "killed by SIGKILL (the kernel's OOM killer)"}
    lines = done.stderr.strip().splitlines()
    return {"status": "error", "error": lines[-1] if lines else f"exit code {done.returncode}"}


def against_one(cell: dict[str, Any], alone: dict[str, Any] | None, key: str) -> str:
    """A measured cell's memory over one process's at the same length, or "-" without that one."""
    return number(ratio(cell.get(key), alone[key])) if alone else "-"


def table(cells: list[dict[str, Any]]) -> str:
    one = {cell["tokens"]: cell for cell in cells if cell["size"] == 1 and cell["status"] == "ok"}
    rows = []
    for cell in cells:
        ok = cell["status"] == "ok"
        alone = one.get(cell["tokens"]) if ok else None
        rows.append(
            {
                "tokens": str(cell["tokens"]),
                "processes": str(cell["size"]),
                "peak per process [GiB]": number(cell.get("peak_memory_bytes"), 2, GB) if ok else cell["status"],
                "step's extra per process [GiB]": number(cell.get("extra_memory_bytes"), 2, GB) if ok else "-",
                "extra / 1 process's": against_one(cell, alone, "extra_memory_bytes"),
                "peak / 1 process's": against_one(cell, alone, "peak_memory_bytes"),
                "tokens/s (all processes)": number(cell.get("tokens_per_second"), 1) if ok else "-",
            }
        )
    return markdown_table(rows)


def longest(cells: list[dict[str, Any]], sizes: Sequence[int]) -> str:
    lines = []
    for size in sizes:
        trained = [cell["tokens"] for cell in cells if cell["size"] == size and cell["status"] == "ok"]
        lines.append(f"- {size} process(es): {max(trained) if trained else 'none of the lengths'}")
    return "\n".join(lines)


def report_text(header: str, cells: list[dict[str, Any]], sizes: Sequence[int]) -> str:
    """The Markdown report: the run's settings, the table, the longest trainable length per size."""
    return f"{header}\n\n{table(cells)}\n\nLongest trainable length of those tried:\n{longest(cells, sizes)}\n"


def write_results(
    output_dir: Path, arguments: argparse.Namespace, header: str, cells: list[dict[str, Any]], complete: bool
) -> list[Path]:
    """results.json and results.md, each written atomically; marked incomplete until the last cell, so that a run
    stopped half-way leaves the cells it measured, said to be partial."""
    results = {
        "complete": complete,
        "arguments": vars(arguments),
        "versions": environment_versions(),
        "hardware": hardware(),
        "header": header,
        "cells": cells,
    }
    atomic_write_text(output_dir / "results.json", json.dumps(results, indent=2) + "\n")
    atomic_write_text(output_dir / "results.md", markdown_file(report_text(header, cells, arguments.sizes), complete))
    return [output_dir / name for name in RESULT_FILES]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arguments = parser.parse_args(argv)
    check_environment(parser.prog)
    check_arguments(parser, arguments)
    output_dir = None
    if arguments.output_dir is not None:
        try:
            output_dir = writable_folder(arguments.output_dir)
        except OutputDirError as error:
            usage_error(parser, str(error))
    spec = ModelSpec(arguments.model, arguments.layers, arguments.intermediate_size)
    cap = f"{arguments.memory_limit_gb:g} GiB a process" if arguments.memory_limit_gb else "no cap"
    header = f"`{spec.label}`, fp32, LoRA, the flag on, {arguments.threads} thread(s) a process, memory cap: {cap}"
    cells: list[dict[str, Any]] = []
    written: list[Path] = []
    with exit_on_interrupt_or_oom(
        PROG,
        on_interrupt=lambda: kept(written),
        on_out_of_memory=lambda error: f"out of memory in the benchmark's own process; {kept(written)}",
    ):
        for tokens in arguments.tokens:
            for size in arguments.sizes:
                task = {
                    "model": {"name": spec.name, "preset_layers": spec.preset_layers,
                              "preset_intermediate_size": spec.preset_intermediate_size},
                    "tokens": tokens, "threads": arguments.threads, "timed_steps": arguments.timed_steps,
                    "gradient_checkpointing": False, "seed": arguments.seed, "timeout": arguments.timeout,
                    "memory_limit_bytes": int(arguments.memory_limit_gb * GB) or None,
                }  # fmt: skip
                result = launch(task, size, arguments.timeout)
                cells.append({"tokens": tokens, "size": size, **result})
                print(f"{tokens} tokens over {size} process(es): {result['status']}", flush=True)
                if output_dir is not None:  # cells so far, so that an interrupted run still leaves them
                    written = write_results(output_dir, arguments, header, cells, complete=False)
    print(report_text(header, cells, arguments.sizes))
    if output_dir is not None:
        written = write_results(output_dir, arguments, header, cells, complete=True)
        print(f"Written: {', '.join(str(path) for path in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
