"""run_lm_eval.py's command line: Optimum-Habana's lm-eval arguments on top of every run_generation.py argument.

The run_generation.py dataclasses are reused as they are, so each model, attention and device flag means the same
in both scripts; the flags that make no sense for an evaluation (prompts, measured runs, results folder) print one
line saying so. Every check here runs before the model loads, and a bad value exits with code 2 and one line.
"""

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import HfArgumentParser

from optimum.habana.cli.common import (
    AttentionArguments,
    check_environment,
    check_finite_numbers,
    json_object,
    writable_folder,
)
from optimum.habana.cli.generation.arguments import (
    SAMPLING_ARGUMENTS,
    ExecutionArguments,
    ModelArguments,
    OutputArguments,
    ScriptArguments,
    WorkloadArguments,
    flag_notes,
    usage_error,
    validate_arguments,
)
from optimum.habana.cli.generation.multi_process import ParallelArguments

from .model import DEFAULT_BUCKETS


# Optimum-Habana's defaults: the four tasks its README reports.
DEFAULT_TASKS = ("hellaswag", "lambada_openai", "piqa", "winogrande")


@dataclass
class LmEvalArguments:
    _argument_group_name = "lm-evaluation-harness"

    output_file: str = field(
        metadata={
            "aliases": ["-o"],
            "help": "Write lm-eval's results, plus `args` (this command line) and `duration` (seconds), to this JSON "
            "file. An existing file is kept unless --overwrite.",
        }
    )
    tasks: list[str] = field(
        default_factory=lambda: list(DEFAULT_TASKS),
        metadata={
            "help": "lm-eval task, group or tag names. The shipped offline tasks essay_perplexity and flash_mc are "
            "always known; the others need their dataset from the Hugging Face Hub (or its local cache)."
        },
    )
    limit: float | None = field(
        default=None,
        metadata={"aliases": ["-L"], "help": "At most this many documents per task (a fraction below 1)."},
    )
    num_fewshot: int | None = field(
        default=None, metadata={"aliases": ["-f"], "help": "Few-shot examples per prompt (default: each task's)."}
    )
    buckets: list[int] | None = field(
        default=None,
        metadata={
            "help": "Pad each batch to the smallest of these lengths that fits (a longer batch adds its own length), "
            "so a compiled model sees few shapes. --static_shapes without --buckets uses Optimum-Habana's "
            "16 32 64 128 189 284 384. Off by default; the scores are the same with and without."
        },
    )
    show_config: bool = field(default=False, metadata={"help": "Print the whole results JSON at the end."})
    log_samples: bool = field(
        default=False, metadata={"help": "Keep every request and the model's answers in the output file (`samples`)."}
    )
    gen_kwargs: str | None = field(
        default=None,
        metadata={"help": "Settings for generate_until tasks, e.g. 'do_sample=True,temperature=0.7,top_p=0.9'."},
    )
    apply_chat_template: str | None = field(
        default=None,
        metadata={
            "nargs": "?",
            "const": True,
            "help": "Wrap prompts in the tokenizer's chat template (or the named one, --apply_chat_template NAME).",
        },
    )
    system_instruction: str | None = field(default=None, metadata={"help": "A system prompt added to each request."})
    fewshot_as_multiturn: bool = field(
        default=False,
        metadata={"help": "With --apply_chat_template: few-shot examples as earlier chat turns (lm-eval's option)."},
    )
    metadata: str | None = field(
        default=None, metadata={"help": "A JSON object handed to the tasks, e.g. '{\"max_seq_lengths\": [4096]}'."}
    )
    max_graphs: int | None = field(
        default=None,
        metadata={"help": "Gaudi: the most HPU graphs kept by --use_hpu_graphs (one per shape). One line elsewhere."},
    )
    confirm_run_unsafe_code: bool = field(
        default=False, metadata={"help": "Allow tasks that execute model-written code (lm-eval's option)."}
    )
    include_path: list[str] | None = field(
        default=None, metadata={"help": "Folders of your own task YAML files, searched before lm-eval's tasks."}
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace an existing --output_file."})


@dataclass
class LmEvalScriptArguments:
    """run_generation.py's arguments (`script`) and the evaluation's (`evaluation`)."""

    script: ScriptArguments
    evaluation: LmEvalArguments

    def as_dict(self) -> dict[str, Any]:
        return {**self.script.as_dict(), **dataclasses.asdict(self.evaluation)}


GROUPS = (
    ModelArguments,
    AttentionArguments,
    WorkloadArguments,
    ExecutionArguments,
    OutputArguments,
    ParallelArguments,
    LmEvalArguments,
)


def build_parser() -> HfArgumentParser:
    """run_generation.py's argument groups, then lm-eval's; `--help` explains each."""
    parser = HfArgumentParser(
        list(GROUPS),
        prog="run_lm_eval.py",
        description="Evaluate a causal LM with lm-evaluation-harness, with the fused attention kernel "
        "(--use_flash_attention) or the default attention.",
    )
    parser.add_argument("--no-ignore_eos", action="store_false", dest="ignore_eos", help=argparse.SUPPRESS)
    return parser


def parse_arguments(parser: HfArgumentParser, argv: Sequence[str] | None) -> tuple[LmEvalScriptArguments, set[str]]:
    """The arguments and the names of the flags given on the command line; a bad value exits with code 2."""
    *groups, evaluation, remaining = parser.parse_args_into_dataclasses(
        args=None if argv is None else list(argv), return_remaining_strings=True
    )
    if remaining:
        usage_error(parser, f"unrecognized arguments: {' '.join(remaining)}")
    check_environment(parser.prog)
    arguments = LmEvalScriptArguments(ScriptArguments(*groups), evaluation)
    try:
        validate_arguments(arguments.script)
        validate_evaluation(arguments.evaluation)
    except ValueError as error:
        usage_error(parser, str(error))
    return arguments, given_flags(parser, argv)


class _Unset(list):
    """A destination the command line did not set; a list, so that `extend` actions (--prompt) grow a copy of it."""


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """Destinations set on the command line: argparse fills defaults only into attributes a namespace lacks."""
    destinations = {action.dest for action in parser._actions if action.dest != argparse.SUPPRESS}
    namespace = argparse.Namespace(**{name: _Unset() for name in destinations})
    parser.parse_known_args(None if argv is None else list(argv), namespace=namespace)
    return {name for name, value in vars(namespace).items() if not (isinstance(value, _Unset) and not value)}


def validate_evaluation(evaluation: LmEvalArguments) -> None:
    """The lm-eval flags' values; a ValueError names the flag."""
    check_finite_numbers(evaluation)
    if evaluation.limit is not None and evaluation.limit <= 0:
        raise ValueError(f"-L/--limit must be positive (a count, or a fraction below 1), got {evaluation.limit}.")
    if evaluation.num_fewshot is not None and evaluation.num_fewshot < 0:
        raise ValueError(f"-f/--num_fewshot must be 0 or more, got {evaluation.num_fewshot}.")
    for bucket in evaluation.buckets or []:
        if bucket < 1:
            raise ValueError(f"--buckets must be positive lengths, got {bucket}.")
    if evaluation.max_graphs is not None and evaluation.max_graphs < 1:
        raise ValueError(f"--max_graphs must be at least 1, got {evaluation.max_graphs}.")
    if not all(name.strip() for name in evaluation.tasks):
        raise ValueError("--tasks has an empty name: give task names such as essay_perplexity flash_mc.")
    if evaluation.fewshot_as_multiturn and not evaluation.apply_chat_template:
        raise ValueError("--fewshot_as_multiturn turns few-shot examples into chat turns: add --apply_chat_template.")
    parse_gen_kwargs(evaluation.gen_kwargs)
    parse_metadata(evaluation.metadata)
    for folder in evaluation.include_path or []:
        if not Path(folder).expanduser().is_dir():
            raise ValueError(f"--include_path {folder!r} is not a folder; pass the folder of your task YAML files.")
    check_output_file(evaluation.output_file, evaluation.overwrite)


def parse_gen_kwargs(text: str | None) -> dict[str, str]:
    """`key=value` pairs separated by commas, as lm-eval reads them; lm-eval itself turns a bare word into a key."""
    if text is None:
        return {}
    pairs = {}
    for part in (part.strip() for part in text.split(",")):
        key, equals, value = part.partition("=")
        if not part or not equals or not key.strip():
            raise ValueError(f"--gen_kwargs takes key=value pairs separated by commas, got {part!r} in {text!r}.")
        pairs[key.strip()] = value.strip()
    return pairs


def parse_metadata(text: str | None) -> dict[str, Any]:
    return {} if text is None else json_object(text, "--metadata")


def check_output_file(output_file: str, overwrite: bool) -> Path:
    """The output path, once its folder can be written and it holds no earlier results (unless --overwrite). A folder
    still to make is not made here (`write_results` makes it): a run refused later leaves nothing behind."""
    path = Path(output_file).expanduser()
    if path.is_dir():
        raise ValueError(f"-o/--output_file {output_file!r} is a folder; pass a file name such as results.json.")
    if path.exists() and not overwrite:
        raise ValueError(
            f"-o/--output_file {output_file!r} exists: refusing to replace earlier results. Pass --overwrite to "
            "replace it, or another file name."
        )
    existing = next(folder for folder in (path.parent, *path.parent.parents) if folder.exists())
    writable_folder(str(existing), flag="-o/--output_file's folder")
    return path


def merged_gen_kwargs(arguments: LmEvalScriptArguments, given: set[str]) -> str | None:
    """--gen_kwargs plus run_generation.py's sampling flags that were given (--gen_kwargs wins a tie)."""
    workload = arguments.script.workload
    pairs = {
        name: str(getattr(workload, name))
        for name in ("do_sample", "num_beams", *SAMPLING_ARGUMENTS)
        if name in given and getattr(workload, name) is not None
    }
    pairs.update(parse_gen_kwargs(arguments.evaluation.gen_kwargs))
    return ",".join(f"{key}={value}" for key, value in pairs.items()) or None


# run_generation.py flags that mean nothing for an evaluation: one line each when given, and no effect.
NOT_USED = {
    "prompt": "not used: the tasks give the texts.",
    "prompt_file": "not used: the tasks give the texts.",
    "book_source": "not used: the tasks give the texts (essay_perplexity reads the same essay).",
    "dataset_name": "not used: the tasks give the texts (--tasks, --include_path for your own data).",
    "column_name": "not used: the tasks give the texts.",
    "ignore_eos": "no effect: lm-eval stops each generation at the task's stop sequences and end-of-sequence.",
    "n_iterations": "no effect: one evaluation is run; run the command again to repeat it.",
    "output_dir": "not used: the results go to -o/--output_file.",
    "overwrite_output_dir": "not used: --overwrite replaces an existing -o/--output_file.",
    "reuse_cache": "lm-eval's batches differ in size and length, so each generate_until batch allocates its own "
    "static cache (as with --static_shapes).",
    "continuous_batching": "no effect: lm-eval's requests run in its own batches (--batch_size) through forward() "
    "and generate().",
    "cb_max_batch_tokens": "no effect: run_lm_eval.py does not use continuous batching.",
}


# Flags that act here (or, like --trim_logits and --attn_batch_split, get their line from run_generation.py's own
# notes). Together with NOT_USED they account for every flag; the tests check that none is left out.
ACTING = {
    *(dataclass_field.name for dataclass_field in dataclasses.fields(AttentionArguments)),
    *(dataclass_field.name for dataclass_field in dataclasses.fields(LmEvalArguments)),
    *(dataclass_field.name for dataclass_field in dataclasses.fields(ModelArguments)),
    *(dataclass_field.name for dataclass_field in dataclasses.fields(ParallelArguments)),
    *("batch_size", "max_input_tokens", "max_new_tokens", "chat", "do_sample", "num_beams", *SAMPLING_ARGUMENTS),
    *("use_kv_cache", "trim_logits", "seed", "bf16", "device", "static_shapes", "use_hpu_graphs"),
    *("torch_compile", "torch_compile_backend"),
    *("bucket_size", "bucket_internal", "limit_hpu_graphs", "sdp_on_bf16", "attn_batch_split", "warmup", "explain"),
}


def evaluation_buckets(arguments: LmEvalScriptArguments, device: torch.device) -> tuple[int, ...]:
    """--buckets, or upstream's default ones where shapes must stay few (static shapes, compilation, HPU graphs)."""
    execution = arguments.script.execution
    static = execution.static_shapes or execution.torch_compile or (execution.use_hpu_graphs and device.type == "hpu")
    return tuple(arguments.evaluation.buckets or (DEFAULT_BUCKETS if static else ()))


def evaluation_notes(
    arguments: LmEvalScriptArguments, given: set[str], device: torch.device, dtype: torch.dtype
) -> list[str]:
    """One line per given flag that does something else here than its name says."""
    workload, execution = arguments.script.workload, arguments.script.execution
    notes = [note for note in flag_notes(arguments.script, device, dtype) if not note.startswith("--prompt:")]
    notes += [f"--{name}: {sentence}" for name, sentence in NOT_USED.items() if name in given]
    if "chat" in given:
        notes.append("--chat: the same as --apply_chat_template here: the tasks' prompts get the chat template.")
    for name in ("do_sample", "num_beams", *SAMPLING_ARGUMENTS):
        if name in given:
            notes.append(f"--{name}: added to --gen_kwargs, so it applies to generate_until tasks.")
    if "warmup" in given and not evaluation_buckets(arguments, device):
        notes.append("--warmup: nothing to warm up without buckets (--buckets or --static_shapes).")
    if arguments.evaluation.max_graphs is not None and not (execution.use_hpu_graphs and device.type == "hpu"):
        notes.append(
            f"--max_graphs: limits the HPU graphs of --use_hpu_graphs on Gaudi; no effect on {device.type} without them."
        )
    if workload.max_input_tokens > 0:
        notes.append(
            f"--max_input_tokens {workload.max_input_tokens}: the longest input the model reads; longer requests keep "
            "their last tokens, and rolling log-likelihood windows are this long."
        )
    return notes
