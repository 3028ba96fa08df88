"""The command line of `examples/text-generation/benchmark_flash_attention.py`: its arguments and their checks."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from transformers import HfArgumentParser

from optimum.habana.cli.benchmarks.models import PRESETS
from optimum.habana.cli.common import check_environment
from optimum.habana.utils.devices import DEVICE_CHOICES
from optimum.habana.utils.model_loading import DEFAULT_MODEL_NAME


RESULT_FILES = ("results.json", "results.csv")
PLOT_FILE = "flash_attention.png"


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
    compare_transformers: bool = field(  # HfArgumentParser adds --compare-transformers itself
        default=False,
        metadata={"help": "Also run stock transformers (attn_implementation 'eager' and 'sdpa') on every row."},
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
            "help": "CPU: how many GiB a measuring process may allocate before its allocations fail (OOM in the "
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
    check_environment(parser.prog)
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
