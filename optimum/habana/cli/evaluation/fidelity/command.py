"""The fidelity table behind `examples/text-generation/attention_fidelity.py`: its arguments, their checks, the run.

"How far is each attention path from the exact answer": the attention output of the fused and the default path
against float64 over a grid of lengths, head dims, GQA ratios and padded batches (`attention`), then a real
model's logits and perplexity on the shipped long text (`model`); `report` writes JSON and
Markdown. Every usage problem is found before the first measurement and exits with status 2, naming the flag.
"""

import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from transformers import AutoConfig, HfArgumentParser

from optimum.habana.cli.common import (
    LONG_PROMPT_PATH,
    OutputDirError,
    check_environment,
    environment_versions,
    exit_on_interrupt_or_oom,
    hardware,
    stop_signals_deferred,
    writable_folder,
)
from optimum.habana.transformers.models import family_problem
from optimum.habana.utils.devices import DEVICE_CHOICES, resolve_device
from optimum.habana.utils.model_loading import DEFAULT_MODEL_NAME, ModelResolutionError, resolve_model
from optimum.habana.utils.pretrained import load_model_and_tokenizer, load_tokenizer

from .attention import DTYPES, GridSpec, build_grid, measure_grid
from .model import measure_model
from .report import RESULT_FILES, judge_targets, markdown, write_report


SCRIPT = "examples/text-generation/attention_fidelity.py"


PARTS = ("attention", "model")


# The default grid: about 40 minutes of one CPU thread on a 2-core AVX2 machine, most of it the default path's bf16
# scores (PyTorch emulates bf16 matmuls there); --quick is a minute or two.
FULL_DEFAULTS: dict[str, Any] = {
    "seq_lens": [512, 1024, 2048, 4096, 8192, 16384],
    "head_dims": [64, 128, 256],
    "gqa": [1, 4, 8],
    "geometry_seq_lens": [2048],
    "padded_seq_lens": [512, 2048, 4096],
    "logit_lens": [512, 2048],
    "ppl_window": 2048,
    "ppl_tokens": 4096,
}


QUICK_DEFAULTS: dict[str, Any] = {
    "seq_lens": [256, 512],
    "head_dims": [64, 128],
    "gqa": [1, 4],
    "geometry_seq_lens": [256],
    "padded_seq_lens": [256],
    "logit_lens": [128],
    "ppl_window": 256,
    "ppl_tokens": 512,
}


def _list(help: str) -> Any:
    return field(default=None, metadata={"nargs": "+", "help": help})


@dataclass
class FidelityArguments:
    output_dir: str | None = field(
        default=None, metadata={"help": f"Write {' and '.join(RESULT_FILES)} there (after every measurement)."}
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace results already in --output_dir."})
    device: str = field(default="auto", metadata={"choices": DEVICE_CHOICES, "help": "auto: HPU, CUDA, then CPU."})
    threads: int | None = field(default=None, metadata={"help": "Torch threads (default: torch's, all cores)."})
    seed: int = field(default=0, metadata={"help": "Seed of the random attention inputs."})
    quick: bool = field(
        default=False, metadata={"help": "A small grid and short model segments (1-2 minutes on a 2-core CPU)."}
    )
    parts: list[str] = field(
        default_factory=lambda: list(PARTS), metadata={"nargs": "+", "help": "attention, model, or both."}
    )
    dtypes: list[str] = field(
        default_factory=lambda: ["fp32", "bf16"],
        metadata={"nargs": "+", "help": f"Input dtypes, of {', '.join(DTYPES)} (fp64 checks the reference itself)."},
    )
    seq_lens: list[int] | None = _list(
        f"Sequence-length sweep, at --base_head_dim and --base_gqa (default {FULL_DEFAULTS['seq_lens']})."
    )
    head_dims: list[int] | None = _list(f"Head dims of the geometry sweep (default {FULL_DEFAULTS['head_dims']}).")
    gqa: list[int] | None = _list(
        f"GQA ratios (query heads per key/value head) of the geometry sweep (default {FULL_DEFAULTS['gqa']}); "
        "query heads = max(2, ratio)."
    )
    geometry_seq_lens: list[int] | None = _list(
        f"Sequence lengths of the geometry sweep (default {FULL_DEFAULTS['geometry_seq_lens']})."
    )
    padded_seq_lens: list[int] | None = _list(
        "Lengths of the left-padded sweep: a batch of a full row and a row of 3N/4 real tokens, at the base geometry "
        f"(default {FULL_DEFAULTS['padded_seq_lens']})."
    )
    base_head_dim: int = field(default=64, metadata={"help": "Head dim of the length and padded sweeps."})
    base_gqa: int = field(default=4, metadata={"help": "GQA ratio of the length and padded sweeps."})
    full_grid: bool = field(
        default=False,
        metadata={
            "help": "Every combination of --seq_lens x --head_dims x --gqa (and --padded_seq_lens x the same) "
            "instead of the three sweeps: cheap on an accelerator, hours on a CPU that emulates bf16."
        },
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": f"The model of the logits and perplexity part; default: the embedded {DEFAULT_MODEL_NAME}."},
    )
    text_file: str | None = field(
        default=None, metadata={"help": f"Text of the model part (default: the shipped {LONG_PROMPT_PATH.name})."}
    )
    logit_lens: list[int] | None = _list(
        f"Prompt lengths (the text's first tokens) of the logits comparison (default {FULL_DEFAULTS['logit_lens']})."
    )
    ppl_window: int | None = field(
        default=None, metadata={"help": f"Perplexity window in tokens (default {FULL_DEFAULTS['ppl_window']})."}
    )
    ppl_tokens: int | None = field(
        default=None,
        metadata={
            "help": f"Perplexity over the text's first this many tokens; 0: all (default {FULL_DEFAULTS['ppl_tokens']})."
        },
    )


def build_parser() -> HfArgumentParser:
    return HfArgumentParser(
        [FidelityArguments],
        prog="attention_fidelity.py",
        description="Max and mean absolute error of the fused and default attention paths against float64: attention "
        "outputs over lengths, head dims, GQA ratios and padded batches, and a model's logits and perplexity.",
    )


def usage_error(parser: HfArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def parse_arguments(parser: HfArgumentParser, argv: Sequence[str] | None) -> FidelityArguments:
    (arguments,) = parser.parse_args_into_dataclasses(args=None if argv is None else list(argv))
    check_environment(parser.prog)
    defaults = QUICK_DEFAULTS if arguments.quick else FULL_DEFAULTS
    for name, value in defaults.items():
        if getattr(arguments, name) is None:
            setattr(arguments, name, value)
    try:
        validate_arguments(arguments)
    except ValueError as error:
        usage_error(parser, str(error))
    return arguments


def validate_arguments(arguments: FidelityArguments) -> None:
    """Checks that need no model; a ValueError names the flag."""
    for name in ("seq_lens", "head_dims", "gqa", "geometry_seq_lens", "padded_seq_lens", "logit_lens"):
        bad = [value for value in getattr(arguments, name) if value < 1]
        if bad:
            raise ValueError(f"--{name} takes positive integers, got {bad}.")
    for name in ("base_head_dim", "base_gqa", "threads", "ppl_window"):
        value = getattr(arguments, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}.")
    if any(value < 4 for value in arguments.padded_seq_lens):
        raise ValueError(
            f"--padded_seq_lens must be at least 4 (a row of 3N/4 real tokens), got {arguments.padded_seq_lens}."
        )
    if any(value < 2 for value in arguments.logit_lens) or arguments.ppl_window < 2:
        raise ValueError("--logit_lens and --ppl_window must be at least 2 tokens (one predicted token).")
    if arguments.ppl_tokens < 0:
        raise ValueError(f"--ppl_tokens must be 0 (the whole text) or more, got {arguments.ppl_tokens}.")
    for name, allowed in (("dtypes", DTYPES), ("parts", PARTS)):
        bad = [value for value in getattr(arguments, name) if value not in allowed]
        if bad:
            raise ValueError(f"--{name}: {', '.join(bad)} not among {', '.join(allowed)}.")
    if arguments.text_file is not None and not Path(arguments.text_file).is_file():
        raise ValueError(f"--text_file {arguments.text_file!r} is not a file.")
    if arguments.output_dir and not arguments.overwrite:
        existing = [name for name in RESULT_FILES if (Path(arguments.output_dir) / name).exists()]
        if existing:
            raise ValueError(
                f"--output_dir {arguments.output_dir} already holds {', '.join(existing)}: choose another folder, or "
                "pass --overwrite to replace them."
            )


@dataclass
class ModelInput:
    resolved: Any
    token_ids: torch.Tensor
    text: Path


def check_model_part(arguments: FidelityArguments) -> ModelInput:
    """Resolve the model and tokenize the text; lengths the model or the text cannot hold are a ValueError."""
    try:
        resolved = resolve_model(arguments.model_name_or_path)
    except ModelResolutionError as error:
        raise ValueError(f"--model_name_or_path: {error}") from None
    config = AutoConfig.from_pretrained(resolved.path)
    problem = family_problem(config.model_type)
    if problem is not None:
        raise ValueError(
            f"--model_name_or_path: {resolved.description} is a {config.model_type!r} model, which has no Gaudi "
            f"class: {problem}."
        )
    positions = getattr(config, "max_position_embeddings", None)
    text = Path(arguments.text_file) if arguments.text_file else LONG_PROMPT_PATH
    token_ids = torch.tensor(load_tokenizer(resolved)(text.read_text(encoding="utf-8"))["input_ids"])
    for name, lengths in (("logit_lens", arguments.logit_lens), ("ppl_window", [arguments.ppl_window])):
        if positions is not None and max(lengths) > positions:
            raise ValueError(f"--{name} {max(lengths)} is beyond the model's {positions} positions.")
    if max(arguments.logit_lens) > len(token_ids):
        raise ValueError(
            f"--logit_lens {max(arguments.logit_lens)} is longer than the text ({len(token_ids)} tokens)."
        )
    return ModelInput(resolved, token_ids, text)


def run(arguments: FidelityArguments, parser: HfArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Measure, write the files after every measurement, print the Markdown report; 0 when done."""
    try:
        device = resolve_device(arguments.device)
        output_dir = writable_folder(arguments.output_dir) if arguments.output_dir else None
        model_input = check_model_part(arguments) if "model" in arguments.parts else None
    except (ValueError, OutputDirError) as error:
        usage_error(parser, str(error))
    if arguments.threads is not None:
        torch.set_num_threads(arguments.threads)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "complete": False,
        "command": shlex.join(["python", SCRIPT, *(sys.argv[1:] if argv is None else argv)]),
        "arguments": asdict(arguments),
        "device": device.type,
        "hardware": hardware(),
        "versions": environment_versions(),
    }

    saved = []

    def save() -> None:
        report["targets"] = judge_targets(report)
        if output_dir is not None:
            saved[:] = write_report(output_dir, report)

    def kept() -> str:
        if not saved:
            return "nothing was written."
        if report["complete"]:
            return f"the run had finished: the complete results are in {', '.join(map(str, saved))}."
        return f"the measurements so far are in {', '.join(map(str, saved))}, marked incomplete."

    def write_again() -> None:
        """A stop inside save() may leave results.json one measurement ahead of results.md: both again, whole."""
        if saved and not report["complete"]:
            save()

    # Ctrl-C, a second Ctrl-C and SIGTERM all end the same way: one line, and files that say how far the run got.
    with exit_on_interrupt_or_oom(
        parser.prog,
        on_interrupt=kept,
        on_out_of_memory=lambda error: (
            f"out of memory ({type(error).__name__}): lower --seq_lens, --logit_lens or --ppl_window; {kept()}"
        ),
        cleanup=write_again,
        sigterm=True,
    ):
        # At once: --overwrite's earlier results, complete ones included, never stand for a run stopped early.
        save()
        measure(arguments, device, model_input, report, save)
        with stop_signals_deferred():  # results.json and results.md say "complete" together, or neither does
            report["complete"] = True
            report["seconds"] = {"wall": time.perf_counter() - started, "process_cpu": time.process_time()}
            save()
        print(markdown(report))
    return 0


def measure(
    arguments: FidelityArguments,
    device: torch.device,
    model_input: ModelInput | None,
    report: dict[str, Any],
    save: Any,
) -> None:
    """Every asked part, each measurement added to `report` and saved as it comes."""

    def add_record(record: dict[str, Any]) -> None:
        report["attention"].append(record)
        save()

    if "attention" in arguments.parts:
        report["attention"] = []
        spec = GridSpec(**{name: getattr(arguments, name) for name in GridSpec.__dataclass_fields__})
        measure_grid(build_grid(spec), device, arguments.seed, add_record)
    if model_input is not None:
        report["model"] = {"model": arguments.model_name_or_path or DEFAULT_MODEL_NAME, "text": model_input.text.name}

        def update(result: dict[str, Any]) -> None:
            report["model"].update(result, tokens_in_text=len(model_input.token_ids))
            save()

        def load(dtype: torch.dtype, on: torch.device) -> Any:
            return load_model_and_tokenizer(
                arguments.model_name_or_path, dtype=dtype, device=on, resolved=model_input.resolved
            ).model

        measure_model(
            load,
            device,
            model_input.token_ids,
            arguments.dtypes,
            arguments.logit_lens,
            arguments.ppl_window,
            arguments.ppl_tokens,
            update,
        )
