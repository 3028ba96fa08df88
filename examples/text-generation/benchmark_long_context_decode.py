#!/usr/bin/env python
"""Decode steps at long context: the flag, the default path and stock transformers side by side in one process.

    python examples/text-generation/benchmark_long_context_decode.py --shapes 1x8192 4x2048 8x512
    python examples/text-generation/benchmark_long_context_decode.py --model_name_or_path llama3-8b-attn \
        --preset_layers 4 --shapes 1x16384 1x32768
    python examples/text-generation/benchmark_long_context_decode.py --continuous_batching --shapes 1x8192

For each batch x context, one prompt is prefilled once and every path decodes from a copy of its cache, with the
cache its generate() builds by default (this library: `GrowingCache`; stock: `DynamicCache`): `--steps` greedy steps
at the context and at 64 tokens, one of each in turn, `--rounds` rounds in alternating order, medians. The table
gives each path's step, its ratio to stock (flag / stock sdpa, default / stock eager), its context cost (step at the
context minus the step at 64 tokens beside it; "below noise" where it is within the spread of the rounds) against
the time to read the keys and values once at the read rate a batch-1 linear layer reaches in the same round (a read
after each pair of steps; each round's cost over its own read, then the median), for latent attention also against
its products' floor (the work of attending over the compressed cache at the rate its largest product reaches here),
the bound (weights and cache read once), the memory its cache holds against what its tokens need, the most memory
its steps needed above that, and whether its tokens equal the default path's. With `--continuous_batching`, rows for
the same prompts served by transformers' continuous-batching engine over its paged cache
(`optimum.habana.cli.benchmarks.paged_decode`). `--dtype bfloat16` runs every path, its cache and the read probe in
bfloat16; `--device cuda` runs them on a GPU. docs/benchmarks.md shows the measured tables.
"""

import argparse
import functools
import sys

import torch
from tabulate import tabulate

from optimum.habana.cli.benchmarks import paged_decode
from optimum.habana.cli.benchmarks.long_context_decode import (
    BASE_CONTEXT,
    MIB,
    PATHS,
    REFERENCE,
    SETTLED_MMAP_THRESHOLD,
    STEP,
    ReadProbe,
    absorbed_product_rate,
    absorbed_products_per_token,
    decode_paths,
    kv_bytes_per_token,
    measure_shape,
    prefill,
    profiled_step,
    prompt_ids,
    set_malloc_thresholds,
)
from optimum.habana.cli.benchmarks.models import PRESETS, ModelSpec, resolve_checkpoint
from optimum.habana.cli.common import check_environment, exit_on_interrupt_or_oom
from optimum.habana.utils.devices import model_size_bytes
from optimum.habana.utils.model_loading import DEFAULT_MODEL_NAME, ModelResolutionError


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shape(text: str) -> tuple[int, int]:
    batch, _, context = text.partition("x")
    if not (batch.isdigit() and context.isdigit()) or int(batch) < 1 or int(context) <= BASE_CONTEXT:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not BATCHxCONTEXT with a batch of at least 1 and a context above {BASE_CONTEXT} tokens"
        )
    return int(batch), int(context)


def where(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{torch.get_num_threads()} threads"


def say(*words: str) -> None:
    print(*words, file=sys.stderr, flush=True)


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model_name_or_path",
        default=DEFAULT_MODEL_NAME,
        help=f"A Llama checkpoint, or a synthetic preset: {', '.join(PRESETS)} (default: embedded SmolLM2).",
    )
    parser.add_argument("--preset_layers", type=int, default=4, help="Layers of a synthetic preset (default 4).")
    parser.add_argument("--preset_intermediate_size", type=int, default=2048, help="MLP size of a synthetic preset.")
    parser.add_argument("--shapes", type=shape, nargs="+", default=[(1, 8192), (4, 2048), (8, 512)])
    parser.add_argument("--steps", type=int, default=12, help="Decode steps per path, context and round.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--random_cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Fill the cache with random keys and values instead of prefilling a prompt (default: for presets).",
    )
    parser.add_argument(
        "--profile",
        nargs="+",
        default=[],
        choices=PATHS,
        help="After the table: where these paths' steps spend their time, per operator (torch.profiler), at the "
        "first shape's context and at 64 tokens.",
    )
    parser.add_argument(
        "--pytorch_kernel",
        action="store_true",
        help="Add a row for the flag on PyTorch's flash kernel instead of the CPU decode kernel "
        "(optimum.habana.kernels.cpu_decode): what the decode kernel gains.",
    )
    parser.add_argument(
        "--whole_context",
        action="store_true",
        help="Add a row for the flag on PyTorch's flash kernel without cutting a one-sequence decode step's context "
        "into pieces for the threads (optimum.habana.kernels.split_context): what the cut gains.",
    )
    parser.add_argument(
        "--continuous_batching",
        action="store_true",
        help="Add rows for the same prompts served by transformers' continuous-batching engine (its paged cache): the "
        "flag reading it in place, the flag on the engine's gather, and stock sdpa. Each run prefills its prompts "
        "through the engine (about 35 s at 1 x 8192 on 2 cores).",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="Where every path runs (default cpu). On cuda the flag runs PyTorch's CUDA kernels: the CPU decode "
        "kernel's rows (--pytorch_kernel, --whole_context) do not apply.",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="The weights', activations' and cache's type on every path (default float32).",
    )
    parser.add_argument("--threads", type=int, default=None, help="Torch threads (default: torch's).")
    arguments = parser.parse_args(argv)
    check_environment(parser.prog)
    for name in ("steps", "rounds", "preset_layers", "preset_intermediate_size"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(arguments, name)}.")
    if arguments.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: PyTorch sees no CUDA device here (torch.cuda.is_available() is False).")
    if arguments.device == "cuda" and (arguments.pytorch_kernel or arguments.whole_context):
        parser.error(
            "--pytorch_kernel and --whole_context compare the CPU decode kernel and its context cut: drop them with "
            "--device cuda."
        )
    if arguments.device == "cuda" and arguments.profile:
        parser.error(
            "--profile reads the CPU's operators (a GPU's time would show as Python): drop it with --device cuda."
        )
    if arguments.threads is not None and arguments.threads < 1:
        parser.error(f"--threads must be at least 1, got {arguments.threads} (leave it out for torch's own count).")
    if arguments.model_name_or_path not in PRESETS:
        try:  # before anything loads: a typo of a preset is told the presets, a missing path says so
            resolve_checkpoint(arguments.model_name_or_path)
        except ModelResolutionError as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
    if arguments.random_cache is None:
        arguments.random_cache = arguments.model_name_or_path in PRESETS and not arguments.continuous_batching
    if arguments.continuous_batching and arguments.random_cache:
        parser.error("--continuous_batching serves real prompts through the engine: drop --random_cache.")
    return arguments


def main(argv: list[str] | None = None, control_malloc: bool = False) -> int:
    arguments = parse_arguments(argv)
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    spec = ModelSpec(arguments.model_name_or_path, arguments.preset_layers, arguments.preset_intermediate_size)
    dtype, device = DTYPES[arguments.dtype], torch.device(arguments.device)
    paths = decode_paths(spec, dtype, arguments.seed, arguments.pytorch_kernel, arguments.whole_context, device)
    config = paths[0].model.config
    per_token = kv_bytes_per_token(config, dtype)
    weights = model_size_bytes(paths[0].model)
    probe = ReadProbe(device, dtype)
    read_rate = probe.rate()
    print(
        f"{spec.label}, {arguments.dtype}, {where(device)}; read rate of a batch-1 linear layer: "
        f"{read_rate / 1e9:.1f} GB/s; weights {weights / MIB:.0f} MiB; keys and values {per_token:,} bytes a token; "
        f"cache {'random' if arguments.random_cache else 'prefilled'}"
    )
    engines = paged_decode.engine_paths(paths) if arguments.continuous_batching else []
    for model in {id(engine.model): engine.model for engine in engines}.values():
        if note := paged_decode.check_positions(
            model, max(context for _, context in arguments.shapes), arguments.steps
        ):
            print(note)
    rows = []
    with exit_on_interrupt_or_oom(
        "benchmark_long_context_decode.py",
        on_interrupt=lambda: "no table was written (it is printed once every shape is measured).",
        on_out_of_memory=lambda error: f"out of memory ({error}); try smaller --shapes.",
    ):
        for batch, context in arguments.shapes:
            say(f"{batch} x {context}: prefilling...")
            kv, first_token = prefill(paths[0].model, batch, context, arguments.seed, arguments.random_cache)
            timings = measure_shape(
                paths,
                kv,
                first_token,
                arguments.steps,
                arguments.rounds,
                progress=functools.partial(say, f"{batch} x {context}:"),
                control_malloc=control_malloc,
                probe=probe,
                kv_bytes=batch * context * per_token,
            )
            del kv
            if engines:
                progress = functools.partial(say, f"{batch} x {context}:")
                ids = prompt_ids(config, batch, context, arguments.seed)
                timings |= paged_decode.measure_engine_shape(engines, ids, arguments.steps, arguments.rounds, progress)
            kv_read = batch * context * per_token / read_rate
            # Latent attention over its compressed cache is bound by its products, not by the read: their floor.
            products = batch * context * absorbed_products_per_token(config)
            products_floor = products / absorbed_product_rate(config, context, dtype, device) if products else None
            bound = batch * read_rate / (weights + batch * context * per_token)
            needed = batch * (context + arguments.steps) * per_token
            for name, timing in timings.items():
                reference = timings.get({**REFERENCE, **paged_decode.REFERENCE}.get(name, ""))
                if reference is None and name in REFERENCE:  # a stock class without sdpa: its eager attention
                    reference = timings.get("stock eager")
                dense = name not in {engine.name for engine in engines}  # the engine's memory: its own, not measured
                rows.append(
                    {
                        "batch x context": f"{batch} x {context}",
                        "path": name,
                        "step [ms]": f"{timing.long_step * 1e3:.1f}",
                        "tok/s": f"{batch / timing.long_step:.1f}",
                        "vs stock": f"{reference.long_step / timing.long_step:.2f}" if reference else "-",
                        "context cost [ms]": (
                            f"{timing.context_cost * 1e3:.1f}"
                            if timing.context_cost_measured
                            else f"below noise ({timing.noise * 1e3:.1f})"
                        ),
                        # each round's read where the path's rounds measured one (the engine's rows: the run's)
                        "KV read once [ms]": f"{(timing.kv_read if timing.round_reads else kv_read) * 1e3:.1f}",
                        "cost / KV read": (
                            (
                                f"{timing.cost_per_read:.2f}"
                                if timing.round_reads
                                else f"{timing.context_cost / kv_read:.2f}"
                            )
                            if timing.context_cost_measured
                            else "-"
                        ),
                        **(
                            {
                                "products floor [ms]": f"{products_floor * 1e3:.1f}",
                                "cost / floor": (
                                    f"{timing.context_cost / products_floor:.2f}"
                                    if timing.context_cost_measured
                                    else "-"
                                ),
                            }
                            if products_floor
                            else {}
                        ),
                        "bound tok/s": f"{bound:.1f}",
                        "cache held / needed [MiB]": (
                            f"{timing.cache_bytes / MIB:.0f} / {needed / MIB:.0f}" if dense else "-"
                        ),
                        "step peak [MiB]": f"{timing.step_peak_bytes / MIB:.0f}" if dense else "-",
                        # the engine's tokens come back on the CPU, the dense paths' on the device
                        "tokens": "same"
                        if torch.equal(timing.tokens.cpu(), timings["default"].tokens.cpu())
                        else "differ",
                    }
                )
    print(tabulate(rows, headers="keys", tablefmt="github", disable_numparse=True))
    if arguments.profile:
        print_profiles(paths, arguments)
    return 0


OUTSIDE = "outside any operator (Python)"


def print_profiles(paths: list, arguments: argparse.Namespace, operators: int = 12) -> None:
    """Per operator, milliseconds of a step at the first shape's context and at BASE_CONTEXT tokens."""
    batch, context = arguments.shapes[0]
    kv, first_token = prefill(paths[0].model, batch, context, arguments.seed, random_cache=True)
    for path in (path for path in paths if path.name in arguments.profile):
        long = profiled_step(path, kv, first_token, context, arguments.steps)
        base = profiled_step(path, kv, first_token, BASE_CONTEXT, arguments.steps)
        for profile in (long, base):
            profile[OUTSIDE] = profile[STEP] - sum(value for name, value in profile.items() if name != STEP)
        names = [name for name in sorted(long, key=lambda name: -long[name]) if name not in (STEP, OUTSIDE)]
        rows = [
            {
                "operator": name,
                f"ms at {context}": f"{long[name] * 1e3:.2f}",
                f"ms at {BASE_CONTEXT}": f"{base.get(name, 0.0) * 1e3:.2f}",
            }
            for name in [*names[:operators], OUTSIDE, STEP]
        ]
        print(f"\n{path.name}, {batch} x {context} (random cache), per step under torch.profiler:")
        print(tabulate(rows, headers="keys", tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    # This process's own malloc: timed under the thresholds glibc settles at, its memory measured apart.
    sys.exit(main(control_malloc=set_malloc_thresholds(SETTLED_MMAP_THRESHOLD)))
