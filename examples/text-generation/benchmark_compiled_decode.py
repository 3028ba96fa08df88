#!/usr/bin/env python
"""Compiled decode with the flag against stock transformers compiled the same way, side by side in one process.

    python examples/text-generation/benchmark_compiled_decode.py --batch_sizes 1 8 --max_new_tokens 48
    python examples/text-generation/benchmark_compiled_decode.py --batch_sizes 1 --max_input_tokens 8192 \
        --max_new_tokens 256

The embedded SmolLM2-135M (fp32) runs generate() with a static KV cache and transformers' own compile of the decode
step (the same CompileConfig, fullgraph) twice over the same weights: as this library's class with
--use_flash_attention, and as stock transformers' class with attn_implementation="sdpa". Batches above 1 are
left-padded prompts of different lengths; with --max_input_tokens every row is that many random tokens instead. The runs alternate between the two; the table gives each one's median decode
tokens/second (the prompt excluded), the ratio, and at batch 1 the read-bandwidth bound: the measured read bandwidth
over the bytes a decode step must read (every weight once, and its static cache), and the rate of the weights'
batch-1 matrix-vector products alone (eager, nothing else of the step). docs/benchmarks.md shows one table.
"""

import argparse
import sys
from typing import NoReturn

import torch
from tabulate import tabulate
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from optimum.habana import GaudiGenerationConfig, GaudiLlamaForCausalLM, hpu
from optimum.habana.cli.benchmarks.compiled_decode import (
    bytes_read_per_decode_step,
    compile_config,
    decode_run,
    median_run,
    read_bandwidth_bytes_per_second,
    weight_gemv_seconds,
)
from optimum.habana.cli.common import check_environment, exit_on_interrupt_or_oom
from optimum.habana.cli.compile_backend import backend_problem, known_backends, offered_backends
from optimum.habana.cli.generation.prompts import DEFAULT_PROMPTS, prompts_for_batch
from optimum.habana.utils.model_loading import ModelResolutionError, resolve_model


PROG = "benchmark_compiled_decode.py"


def usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def check_backend(backend: str) -> None:
    """A ValueError naming --backend unless torch.compile can run it here, on CPU (where this script measures: not
    Gaudi's backend); otherwise the error came as a traceback once both models had loaded and compiled."""
    allowed = known_backends() - {hpu.COMPILE_BACKEND}
    if backend not in allowed:
        raise ValueError(
            f"--backend {backend} is not a torch.compile backend this script can use (it compiles on CPU); choose "
            f"one of: {', '.join(sorted(offered_backends() & allowed))}."
        )
    problem = backend_problem(backend)
    if problem is not None:
        raise ValueError(
            f"--backend {backend} cannot compile here ({problem}): take inductor (the default), or install what "
            "this backend needs."
        )


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, each checked before any model loads; `checkpoint` is the resolved --model_name_or_path."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_name_or_path", default=None, help="A Llama checkpoint (default: embedded SmolLM2).")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument(
        "--max_input_tokens", type=int, default=None, help="Prompts of this many random tokens (default: built-in)."
    )
    parser.add_argument("--n_iterations", type=int, default=3, help="Measured runs per model and batch size.")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor).")
    parser.add_argument(
        "--bandwidth_gib", type=float, default=1.0, help="GiB summed to measure read bandwidth (far above the caches)."
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="Torch threads, at least 1 (default, left out: torch's)."
    )
    arguments = parser.parse_args(argv)
    check_environment(parser.prog)
    try:
        check_values(arguments)
        check_backend(arguments.backend)
    except ValueError as error:
        usage_error(parser, str(error))
    try:
        arguments.checkpoint = resolve_model(arguments.model_name_or_path).path
    except ModelResolutionError as error:
        message = str(error)
        usage_error(parser, message if "--model_name_or_path" in message else f"--model_name_or_path: {message}")
    return arguments


def check_values(arguments: argparse.Namespace) -> None:
    """Numbers that cannot run; a ValueError names the flag."""
    if arguments.max_new_tokens < 2:
        raise ValueError(
            f"--max_new_tokens must be at least 2 (a decode step after the first token), got {arguments.max_new_tokens}."
        )
    if arguments.max_input_tokens is not None and arguments.max_input_tokens < 1:
        raise ValueError(f"--max_input_tokens must be at least 1, got {arguments.max_input_tokens}.")
    if arguments.n_iterations < 1:
        raise ValueError(f"--n_iterations must be at least 1, got {arguments.n_iterations}.")
    if not arguments.bandwidth_gib > 0:
        raise ValueError(f"--bandwidth_gib must be positive, got {arguments.bandwidth_gib}.")
    if min(arguments.batch_sizes) < 1:
        raise ValueError(f"--batch_sizes must be at least 1, got {min(arguments.batch_sizes)}.")
    if arguments.threads is not None and arguments.threads < 1:
        raise ValueError(
            f"--threads must be at least 1, got {arguments.threads} (leave it out for torch's own count)."
        )


def random_prompts(batch: int, length: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """`batch` rows of `length` random token ids (fixed seed), no padding."""
    ids = torch.randint(3, vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    if arguments.threads is not None:
        torch.set_num_threads(arguments.threads)
    path = arguments.checkpoint
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    ours = GaudiLlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    stock.load_state_dict(ours.state_dict())
    device = torch.device("cpu")
    bandwidth = read_bandwidth_bytes_per_second(device, arguments.bandwidth_gib)
    print(
        f"Read bandwidth: {bandwidth / 1e9:.1f} GB/s (sum over {arguments.bandwidth_gib:g} GiB), "
        f"threads {torch.get_num_threads()}"
    )

    gemv_seconds = weight_gemv_seconds(ours)
    rows = []
    with exit_on_interrupt_or_oom(
        PROG,
        on_interrupt=lambda: "no table was written (it is printed once every batch size is measured).",
        on_out_of_memory=lambda error: f"out of memory ({error}); try smaller --batch_sizes.",
    ):
        for batch in arguments.batch_sizes:
            if arguments.max_input_tokens is None:
                inputs = tokenizer(
                    prompts_for_batch(DEFAULT_PROMPTS, batch), return_tensors="pt", padding=True, padding_side="left"
                )
            else:
                inputs = random_prompts(batch, arguments.max_input_tokens, tokenizer.vocab_size)
            settings = {
                "max_new_tokens": arguments.max_new_tokens,
                "min_new_tokens": arguments.max_new_tokens,
                "do_sample": False,
                "pad_token_id": tokenizer.pad_token_id,
                "cache_implementation": "static",
                "compile_config": compile_config(device, arguments.backend),
            }
            calls = {
                "flag": (ours, GaudiGenerationConfig(**settings, use_flash_attention=True)),
                "stock sdpa": (stock, GenerationConfig(**settings)),
            }
            runs: dict[str, list] = {name: [] for name in calls}
            for name, (model, generation_config) in calls.items():  # the warm-up compiles each model's decode step
                print(f"batch {batch}: compiling {name}...", file=sys.stderr, flush=True)
                decode_run(model, dict(inputs), generation_config)
            for _ in range(arguments.n_iterations):
                for name, (model, generation_config) in calls.items():
                    runs[name].append(decode_run(model, dict(inputs), generation_config))
            flag, reference = median_run(runs["flag"]), median_run(runs["stock sdpa"])
            cache_length = inputs["input_ids"].shape[1] + arguments.max_new_tokens
            bound = bandwidth / bytes_read_per_decode_step(ours, batch, cache_length)
            rows.append(
                {
                    "batch": batch,
                    "flag decode tok/s": f"{flag.decode_tokens_per_second:.1f}",
                    "stock sdpa decode tok/s": f"{reference.decode_tokens_per_second:.1f}",
                    "flag / stock": f"{flag.decode_tokens_per_second / reference.decode_tokens_per_second:.2f}",
                    "read-bound tok/s": f"{bound * batch:.1f}" if batch == 1 else "-",
                    "flag / bound": f"{flag.decode_tokens_per_second / bound:.2f}" if batch == 1 else "-",
                    "weight GEMVs alone tok/s": f"{1 / gemv_seconds:.1f}" if batch == 1 else "-",
                }
            )
    print(tabulate(rows, headers="keys", tablefmt="github", disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
