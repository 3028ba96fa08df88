#!/usr/bin/env python
"""One long sequence's training step split over 1, 2, ... processes (context parallelism): memory per process,
tokens per second, and the longest length that trains under a memory cap.

    python examples/language-modeling/benchmark_context_parallel.py --model smollm2-attn --layers 4 \\
        --tokens 4096 8192 16384 32768 --sizes 1 2 --threads 1 --memory_limit_gb 6

Each cell is one torchrun launch of `--sizes` processes over gloo (`context_parallel_worker`): the flag on, LoRA on
the attention projections, fp32, one sequence of `--tokens` tokens cut into equal parts. Memory is per process: the
largest of the processes' peak resident memory (`peak`) and of its growth during the step (`extra`, the step's
activations and gradients). Every process may grow by `--memory_limit_gb` at most during the step: beyond that its
allocations fail (OOM), and the longest trainable length of a size is the longest `--tokens` that did not.
Prints the table in markdown and writes results.json and results.md into `--output_dir` when given.
"""

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from optimum.habana.cli.benchmarks.models import PRESETS, ModelSpec
from optimum.habana.cli.benchmarks.tables import GB, markdown_table, number
from optimum.habana.cli.benchmarks.workers import RESULT_MARKER, ratio
from optimum.habana.cli.common import OutputDirError, check_environment, writable_folder


PROG = "benchmark_context_parallel.py"
WORKER = "optimum.habana.cli.benchmarks.training.context_parallel_worker"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(PRESETS), default="smollm2-attn", help="A synthetic preset.")
    parser.add_argument("--layers", type=int, default=4, help="Decoder layers of the preset.")
    parser.add_argument("--intermediate_size", type=int, default=1536, help="MLP width of the preset.")
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 8192, 16384])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2], help="Processes each sequence is split over.")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per process.")
    parser.add_argument(
        "--timed_steps", type=int, default=1, help="Timed steps after the memory step (fastest); 0: memory only."
    )
    parser.add_argument("--memory_limit_gb", type=float, default=0, help="Cap on each process's step, GiB (0: none).")
    parser.add_argument("--timeout", type=float, default=1800.0, help="Seconds per launch; past it: timeout.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default=None, help="Write results.json and results.md there.")
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
    if arguments.memory_limit_gb < 0:
        usage_error(parser, f"--memory_limit_gb must be 0 (no cap) or more, got {arguments.memory_limit_gb}.")


def launch(task: dict[str, Any], size: int, timeout: float) -> dict[str, Any]:
    """One torchrun launch of `size` processes; the result rank 0 (or an out-of-memory process) printed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={size}"]
    command += ["-m", WORKER, json.dumps(task)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout"}
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
                "tokens/s": number(cell.get("tokens_per_second"), 1) if ok else "-",
            }
        )
    return markdown_table(rows)


def longest(cells: list[dict[str, Any]], sizes: Sequence[int]) -> str:
    lines = []
    for size in sizes:
        trained = [cell["tokens"] for cell in cells if cell["size"] == size and cell["status"] == "ok"]
        lines.append(f"- {size} process(es): {max(trained) if trained else 'none of the lengths'}")
    return "\n".join(lines)


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
    cells = []
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
    cap = f"{arguments.memory_limit_gb:g} GiB a process" if arguments.memory_limit_gb else "no cap"
    report = (
        f"`{spec.label}`, fp32, LoRA, the flag on, {arguments.threads} thread(s) a process, memory cap: {cap}\n\n"
        f"{table(cells)}\n\nLongest trainable length of those tried:\n{longest(cells, arguments.sizes)}\n"
    )
    print(report)
    if output_dir is not None:
        (output_dir / "results.json").write_text(json.dumps(cells, indent=2))
        (output_dir / "results.md").write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
