#!/usr/bin/env python
"""One training step (forward + backward) of a padding-free packed batch, or a padded one, per attention path,
against the floor.

    python examples/language-modeling/benchmark_packed_step.py --examples 8 --example_tokens 1024
    python examples/language-modeling/benchmark_packed_step.py --torch_compile --batch padded

The batch is `--examples` random examples of `--example_tokens` tokens packed into one row by transformers'
`DataCollatorWithFlattening` (position ids restarting per example), or with `--batch padded` one row per example,
right-padded (row i loses i / (2 x --examples) of its tokens to padding), on a synthetic preset (real attention
geometry, random weights, `--layers` layers; see benchmark_flash_attention.py) with gradient checkpointing. Each path
runs in a fresh process: the first step gives the extra memory (peak resident memory above what the built model
holds), the second the step time. With `--torch_compile` the model is compiled (fullgraph) and a first step compiles
it; the peak is then reset (/proc/self/clear_refs) before the measured steps. Paths: `floor` (attention replaced by
a pass-through of V: what no attention can go below), `flash` (this library, --use_flash_attention), `default` (this
library's matmul-softmax), `sdpa` and `eager` (stock transformers). Prints a Markdown table and the flash / floor ratios; docs/fine_tuning.md shows one.
"""

import argparse
import json
import math
import subprocess
import sys
import time
from typing import NoReturn

import torch
from tabulate import tabulate
from transformers import DataCollatorWithFlattening

from optimum.habana.cli.benchmarks import workers
from optimum.habana.cli.benchmarks.models import PRESETS, ModelSpec, build_model
from optimum.habana.cli.benchmarks.workers import ratio
from optimum.habana.cli.common import check_environment, exit_on_interrupt_or_oom
from optimum.habana.utils.devices import memory_stats, reset_peak_memory


PATHS = ("floor", "flash", "default", "sdpa", "eager")
RESULT_MARKER = "PACKED_STEP_RESULT "
PROG = "benchmark_packed_step.py"


def usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """A value that cannot run: one line naming the flag, exit 2."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="smollm2-attn")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate_size", type=int, default=1536)
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--example_tokens", type=int, default=1024)
    parser.add_argument(
        "--batch", choices=("packed", "padded"), default="packed", help="Padding-free packed row, or padded rows."
    )
    parser.add_argument("--torch_compile", action="store_true", help="Compile the model (fullgraph) first.")
    parser.add_argument("--torch_compile_backend", default=None, help="With --torch_compile (default: inductor).")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument(
        "--threads", type=int, default=None, help="Torch threads per process, at least 1 (default, left out: torch's)."
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="Seconds per path; past it: timeout.")
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    check_environment(parser.prog)
    for name in ("layers", "intermediate_size", "examples", "example_tokens"):
        if getattr(arguments, name) < 1:
            usage_error(parser, f"--{name} must be at least 1, got {getattr(arguments, name)}.")
    if arguments.threads is not None and arguments.threads < 1:
        usage_error(
            parser, f"--threads must be at least 1, got {arguments.threads} (leave it out for torch's own count)."
        )
    if not 0 < arguments.timeout < math.inf:
        usage_error(parser, f"--timeout must be a positive number of seconds, got {arguments.timeout}.")
    if arguments.torch_compile_backend is not None and not arguments.torch_compile:
        usage_error(
            parser,
            f"--torch_compile_backend {arguments.torch_compile_backend} picks the backend: add --torch_compile.",
        )
    arguments.torch_compile_backend = arguments.torch_compile_backend or "inductor"
    return arguments


def training_batch(arguments: argparse.Namespace, vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    rows = [
        torch.randint(3, vocab, (arguments.example_tokens,), generator=generator) for _ in range(arguments.examples)
    ]
    if arguments.batch == "packed":
        return DataCollatorWithFlattening()([{"input_ids": row.tolist(), "labels": row.tolist()} for row in rows])
    input_ids = torch.stack(rows)
    attention_mask = torch.ones_like(input_ids)
    for index in range(arguments.examples):
        attention_mask[
            index, arguments.example_tokens - index * arguments.example_tokens // (2 * arguments.examples) :
        ] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def measure(arguments: argparse.Namespace) -> dict[str, float]:
    """In the worker process: one step for the memory, a second one for the time."""
    if arguments.threads is not None:
        torch.set_num_threads(arguments.threads)
    spec = ModelSpec(arguments.preset, arguments.layers, arguments.intermediate_size)
    model = build_model(spec, arguments.worker, torch.float32, seed=0)
    if arguments.worker == "flash":
        model.generation_config.use_flash_attention = True
    model.gradient_checkpointing_enable()
    model.config.use_cache = False  # as a training run sets it: with checkpointing, a cache is only a warning
    model.train()
    batch = training_batch(arguments, model.config.vocab_size)
    step = model
    cpu = torch.device("cpu")
    if arguments.torch_compile:
        step = torch.compile(model, fullgraph=True, dynamic=False, backend=arguments.torch_compile_backend)
        step(**batch).loss.backward()  # compiles the forward and the backward
        model.zero_grad(set_to_none=True)
        reset_peak_memory(cpu)  # compiling left its own peak behind
    before = memory_stats(cpu)["max_allocated"]
    step(**batch).loss.backward()
    extra = memory_stats(cpu)["max_allocated"] - before
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    step(**batch).loss.backward()
    return {"step_seconds": time.perf_counter() - start, "extra_memory_gib": extra / 1024**3}


def run_path(path: str, argv: list[str], timeout: float) -> dict[str, float | str]:
    """One path in a fresh process; past `timeout` it is stopped with whatever it started (inductor's compile
    workers: `workers.run_command`)."""
    command = [sys.executable, __file__, *argv, "--worker", path]
    try:
        done = workers.run_command(command, timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return {"status": "ok", **json.loads(line[len(RESULT_MARKER) :])}
    lines = done.stderr.strip().splitlines()
    return {"status": "OOM" if done.returncode == -9 else "error", "error": lines[-1] if lines else done.returncode}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    arguments = parse_arguments(argv)
    if arguments.worker:
        print(RESULT_MARKER + json.dumps(measure(arguments)), flush=True)
        return 0
    with exit_on_interrupt_or_oom(
        PROG,
        on_interrupt=lambda: "nothing was written (the table is printed once every path is measured).",
        on_out_of_memory=lambda error: "out of memory in the benchmark's own process; nothing was written.",
    ):
        results = {path: run_path(path, argv, arguments.timeout) for path in arguments.paths}
    floor = results.get("floor", {})
    rows = []
    for path, result in results.items():
        if result["status"] != "ok":
            rows.append([path, result["status"], result["status"], "-", "-"])
            continue
        # ratio() is None where the floor has no measurement, or measured 0 (its step raised no resident peak).
        time_ratio = ratio(result["step_seconds"], floor.get("step_seconds"))
        memory_ratio = ratio(result["extra_memory_gib"], floor.get("extra_memory_gib"))
        rows.append(
            [
                path,
                f"{result['step_seconds']:.2f}",
                f"{result['extra_memory_gib']:.2f}",
                "-" if time_ratio is None else f"{time_ratio:.2f}",
                "-" if memory_ratio is None else f"{memory_ratio:.2f}",
            ]
        )
    tokens = arguments.examples * arguments.example_tokens
    layout = f"packed into one row of {tokens}" if arguments.batch == "packed" else "right-padded, one row each"
    compiled = f", torch.compile ({arguments.torch_compile_backend}, fullgraph)" if arguments.torch_compile else ""
    threads = arguments.threads or torch.get_num_threads()
    print(
        f"{arguments.preset}, {arguments.layers} layers, {arguments.examples} examples x {arguments.example_tokens} "
        f"tokens {layout}, gradient checkpointing, fp32{compiled}, torch threads {threads}"
    )
    headers = ["Path", "Step [s]", "Extra memory [GiB]", "Step / floor", "Extra memory / floor"]
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    failed = [path for path, result in results.items() if result["status"] == "error"]
    for path in failed:
        print(f"{path}: failed: {results[path]['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
