#!/usr/bin/env python
"""Serving throughput: continuous batching with the flag against static padded batches and stock transformers.

    python examples/text-generation/benchmark_continuous_batching.py --output_dir outputs/cb_benchmark

The same requests (`--requests` prompts of `--min_prompt_tokens` to `--max_prompt_tokens` tokens, seeded, cut
from the long text shipped with the examples) each get `--max_new_tokens` greedy tokens, end-of-sequence ignored,
in fp32 on the embedded SmolLM2-135M-Instruct (or `--model`), through each path (`cb_benchmark_worker`):
`cb_flash` and `cb_default` (the Gaudi class through transformers' continuous batching, flag on / off),
`stock_cb_sdpa` (the stock class with sdpa through the same engine and cache geometry) and `static_flash`
(the Gaudi class with the flag through `generate()` in left-padded batches of `--static_batch_size`).

Each path runs in a fresh process, `--repeats` times in an order that rotates from one repeat to the next; a path's
throughput is its best repeat (a slower one is the machine's other work, not the path). Memory is the process's
peak resident memory during the measured batch (`extra`: above what was resident before it). Writes results.json
and results.md into `--output_dir` after every run (`"complete": false` until the last); docs/continuous_batching.md
shows the table and the two targets.
"""

import json
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate
from transformers import AutoConfig, HfArgumentParser

from optimum.habana.cli.benchmarks import workers
from optimum.habana.cli.benchmarks.continuous_batching.worker import PATHS
from optimum.habana.cli.benchmarks.tables import GB, kept, markdown_file
from optimum.habana.cli.benchmarks.workers import ratio
from optimum.habana.cli.common import OutputDirError, check_environment, exit_on_interrupt_or_oom, writable_folder
from optimum.habana.utils.atomic import atomic_write_text
from optimum.habana.utils.model_loading import ModelResolutionError, resolve_model


PROG = "benchmark_continuous_batching.py"
WORKER = "optimum.habana.cli.benchmarks.continuous_batching.worker"
# The targets: continuous batching with the flag against static batches, and against stock transformers.
TARGETS = (("static_flash", 2.0), ("stock_cb_sdpa", 1.0))


@dataclass
class Arguments:
    model: str | None = field(default=None, metadata={"help": "Checkpoint folder or hub id (default: embedded)."})
    requests: int = field(default=32, metadata={"help": "Number of requests."})
    min_prompt_tokens: int = field(default=16, metadata={"help": "Shortest prompt."})
    max_prompt_tokens: int = field(default=512, metadata={"help": "Longest prompt."})
    max_new_tokens: int = field(default=64, metadata={"help": "New tokens per request (end-of-sequence ignored)."})
    static_batch_size: int = field(default=8, metadata={"help": "Batch size of the static_flash path."})
    max_batch_tokens: int = field(default=512, metadata={"help": "Continuous batching: tokens per engine step."})
    paths: list[str] = field(default_factory=lambda: list(PATHS), metadata={"choices": PATHS, "nargs": "+"})
    repeats: int = field(default=2, metadata={"help": "Runs per path; the best counts."})
    threads: int = field(default=0, metadata={"help": "torch threads per worker (0: torch's default)."})
    seed: int = field(default=0, metadata={"help": "Seed of the prompt lengths."})
    timeout: float = field(default=1800, metadata={"help": "Seconds before a worker counts as timed out."})
    output_dir: str | None = field(default=None, metadata={"help": "Write results.json and results.md here."})
    overwrite: bool = field(default=False, metadata={"help": "Replace the results of an earlier run there."})


def check(arguments: Arguments) -> None:
    """Values that cannot run, refused before any worker starts (every run would fail alike); a ValueError names the
    flag."""
    for name in (
        "requests",
        "min_prompt_tokens",
        "max_new_tokens",
        "static_batch_size",
        "max_batch_tokens",
        "repeats",
    ):
        if getattr(arguments, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(arguments, name)}.")
    if arguments.max_prompt_tokens < arguments.min_prompt_tokens:
        raise ValueError("--max_prompt_tokens must be at least --min_prompt_tokens.")
    if arguments.threads < 0:
        raise ValueError(f"--threads must be 0 (torch's default) or more, got {arguments.threads}.")
    if not 0 < arguments.timeout < math.inf:
        raise ValueError(f"--timeout must be a positive number of seconds, got {arguments.timeout}.")
    positions = getattr(
        AutoConfig.from_pretrained(resolve_model(arguments.model).path), "max_position_embeddings", None
    )
    if positions is not None and arguments.max_prompt_tokens + arguments.max_new_tokens > positions:
        raise ValueError(
            f"--max_prompt_tokens {arguments.max_prompt_tokens} + --max_new_tokens {arguments.max_new_tokens} pass the "
            f"model's {positions} positions (max_position_embeddings): lower them to {positions} tokens in all."
        )
    if arguments.output_dir:
        folder = writable_folder(arguments.output_dir)
        existing = [name for name in ("results.json", "results.md") if (folder / name).exists()]
        if existing and not arguments.overwrite:
            raise ValueError(f"--output_dir {arguments.output_dir!r} holds {existing[0]}: add --overwrite to replace.")


def prompt_lengths(arguments: Arguments) -> list[int]:
    generator = random.Random(arguments.seed)
    return [
        generator.randint(arguments.min_prompt_tokens, arguments.max_prompt_tokens) for _ in range(arguments.requests)
    ]


def run(arguments: Arguments, on_result: Any = None) -> dict[str, Any]:
    lengths = prompt_lengths(arguments)
    task = {
        "model": arguments.model,
        "prompt_lengths": lengths,
        "max_new_tokens": arguments.max_new_tokens,
        "static_batch_size": arguments.static_batch_size,
        "max_batch_tokens": arguments.max_batch_tokens,
        "threads": arguments.threads,
    }
    runs: dict[str, list[dict[str, Any]]] = {path: [] for path in arguments.paths}
    for repeat in range(arguments.repeats):
        order = arguments.paths[repeat % len(arguments.paths) :] + arguments.paths[: repeat % len(arguments.paths)]
        for path in order:
            result = workers.run_worker({**task, "path": path}, arguments.timeout, worker=WORKER)
            print(f"repeat {repeat + 1} {path}: {describe(result)}", file=sys.stderr, flush=True)
            runs[path].append(result)
            if on_result is not None:  # what is measured so far survives a run killed before its end
                on_result(summarize(arguments, lengths, runs))
    return summarize(arguments, lengths, runs)


def summarize(arguments: Arguments, lengths: list[int], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    best = {path: best_run(results) for path, results in runs.items() if results}
    return {
        "arguments": asdict(arguments),
        "prompt_lengths": lengths,
        "complete": all(len(results) == arguments.repeats for results in runs.values()),
        "paths": best,
        "runs": runs,
        "targets": targets(best),
    }


def best_run(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    done = [result for result in results if result.get("status") == "ok"]
    return max(done, key=lambda result: result["throughput_tokens_per_second"]) if done else results[0]


def describe(result: dict[str, Any]) -> str:
    if result.get("status") != "ok":
        return f"{result.get('status')}: {result.get('error')}"
    return (
        f"{result['throughput_tokens_per_second']:.1f} tokens/s in {result['seconds']:.1f} s, peak "
        f"{result['peak_memory_bytes'] / GB:.2f} GiB"
    )


def throughput(best: dict[str, dict[str, Any]], path: str) -> float | None:
    return best.get(path, {}).get("throughput_tokens_per_second")


def targets(best: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for baseline, minimum in TARGETS:
        value = ratio(throughput(best, "cb_flash"), throughput(best, baseline))
        rows.append(
            {
                "baseline": baseline,
                "minimum": minimum,
                "ratio": value,
                "met": None if value is None else value >= minimum,
            }
        )
    return rows


def markdown(results: dict[str, Any]) -> str:
    best = results["paths"]
    reference = best.get("static_flash", {}).get("tokens_sha256")
    rows = []
    for path, result in best.items():
        if result.get("status") != "ok":
            rows.append([path, result.get("status"), "", "", "", "", "", ""])
            continue
        rows.append(
            [
                path,
                f"{result['throughput_tokens_per_second']:.1f}",
                fmt(ratio(result["throughput_tokens_per_second"], throughput(best, "static_flash"))),
                fmt(ratio(result["throughput_tokens_per_second"], throughput(best, "stock_cb_sdpa"))),
                f"{result['seconds']:.1f}",
                f"{result['peak_memory_bytes'] / GB:.2f}",
                f"{result['extra_memory_bytes'] / GB:.3f}",
                "" if reference is None else ("yes" if result["tokens_sha256"] == reference else "no"),
            ]
        )
    headers = [
        "path",
        "tokens/s",
        "× static_flash",
        "× stock_cb_sdpa",
        "seconds",
        "peak GiB",
        "extra GiB",
        "same tokens",
    ]
    lines = [tabulate(rows, headers=headers, tablefmt="github"), ""]
    for target in results["targets"]:
        verdict = "n/a" if target["met"] is None else ("met" if target["met"] else "not met")
        lines.append(f"- cb_flash ≥ {target['minimum']:g}× {target['baseline']}: {fmt(target['ratio'])} ({verdict})")
    return "\n".join(lines) + "\n"


def write(arguments: Arguments, results: dict[str, Any]) -> list[Path]:
    """results.json and results.md, each written atomically; both marked incomplete until the last run."""
    if not arguments.output_dir:
        return []
    folder = Path(arguments.output_dir)
    atomic_write_text(folder / "results.json", json.dumps(results, indent=2) + "\n")
    atomic_write_text(folder / "results.md", markdown_file(markdown(results), results["complete"]))
    return [folder / "results.json", folder / "results.md"]


def fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = HfArgumentParser(Arguments, prog=PROG, description=__doc__.split("\n\n")[0])
    (arguments,) = parser.parse_args_into_dataclasses(args=argv)
    check_environment(parser.prog)
    # A path named twice would run twice a repeat, and its repeats would never add up to a complete run.
    arguments.paths = list(dict.fromkeys(arguments.paths))
    try:
        check(arguments)
    except (ValueError, OutputDirError, ModelResolutionError) as error:
        parser.exit(2, f"{PROG}: error: {error}\n")
    written: list[Path] = []

    def save(partial: dict[str, Any]) -> None:
        written[:] = write(arguments, partial)

    with exit_on_interrupt_or_oom(
        PROG,
        on_interrupt=lambda: kept(written),
        on_out_of_memory=lambda error: f"out of memory in the benchmark's own process; {kept(written)}",
    ):
        results = run(arguments, on_result=save)
    print(markdown(results))
    if arguments.output_dir:
        write(arguments, results)
        print(f"Results written to {arguments.output_dir}")
    failed = [path for path, result in results["paths"].items() if result.get("status") != "ok"]
    if failed:
        print(f"{PROG}: no successful run for {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
