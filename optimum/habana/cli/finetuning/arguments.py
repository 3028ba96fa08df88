"""run_lora_clm.py's command line: its argument groups, their parsing and the checks that need no model.

Every usage problem becomes one message (`usage_error`, exit status 2) before anything loads; the checks that need
data or a model live in the script.
"""

from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from transformers import HfArgumentParser, TrainingArguments

from optimum.habana.cli.common import AttentionArguments, check_environment, check_finite_numbers, check_seed
from optimum.habana.cli.compile_backend import check_compile_backend
from optimum.habana.utils.distributed import launch_environment

from .errors import FineTuningError
from .gaudi_arguments import (
    GaudiTrainingArguments,
    apply_gaudi_training_arguments,
    attention_flag_from,
    check_gaudi_training_arguments,
)
from .peft_methods import PeftArguments
from .sharding import data_parallel_launch_problem, prepare_sharding_arguments


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A local checkpoint folder of a supported family, a .gguf file or a hub repo id; by default the embedded "
            "SmolLM2-135M-Instruct (same resolution as run_generation.py)."
        },
    )
    low_cpu_mem_usage: bool = field(
        default=False, metadata={"help": "Accepted for Optimum-Habana's command lines: transformers 5 always is."}
    )
    config_name: str | None = field(
        default=None, metadata={"help": "Load the model's config from here instead of from the model's folder."}
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Load the tokenizer from here instead of from the model's folder."}
    )
    token: str | None = field(default=None, metadata={"help": "Hugging Face Hub token for gated models and data."})
    use_auth_token: bool = field(default=False, metadata={"help": "Deprecated upstream: use --token."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where hub downloads are cached."})
    model_revision: str = field(default="main", metadata={"help": "Hub revision (branch, tag or commit) to load."})
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "transformers 5 has one tokenizer class."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run a hub model's own code (not used here)."})
    load_meta_device: bool = field(default=False, metadata={"help": "Build the model on the meta device first."})
    flash_attention_fp8: bool = field(default=False, metadata={"help": "Gaudi: fused attention in fp8."})
    torch_dtype: str = field(
        default="auto",
        metadata={
            "help": "Dtype of the base model's weights; auto: bfloat16 with --bf16, else float32. "
            "LoRA weights stay in float32.",
            "choices": ["auto", *DTYPES],
        },
    )


@dataclass
class DataArguments:
    train_file: str | None = field(
        default=None,
        metadata={
            "help": "json, jsonl, csv or txt file: instruction data (instruction/input/output fields) or plain text "
            "(a text field; one example per line for txt). Default: the shipped data/instructions.jsonl."
        },
    )
    validation_file: str | None = field(default=None, metadata={"help": "Same formats as --train_file."})
    dataset_name: str | None = field(
        default=None, metadata={"help": "A dataset on the Hugging Face Hub, instead of --train_file."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The hub dataset's configuration."})
    validation_split_percentage: int = field(
        default=10,
        metadata={"help": "Percent of the training data held out for evaluation when there is no validation data."},
    )
    max_seq_length: int = field(
        default=512,
        metadata={
            "aliases": ["--max_seq_len"],  # Optimum-Habana's README spells it so
            "help": "Longest tokenized example (or packed block with --dataset_concatenation).",
        },
    )
    dataset_concatenation: bool = field(
        default=False,
        metadata={
            "help": "Pack the tokenized examples into blocks of exactly --max_seq_length tokens: no padding, "
            "and every block attends causally across example boundaries."
        },
    )
    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Concatenate each batch's examples into one row (transformers' DataCollatorWithFlattening): no "
            "padding, and every example attends to itself alone (with --use_flash_attention one kernel call per "
            "example, no mask)."
        },
    )
    pad_to_max_length: bool = field(
        default=False, metadata={"help": "Pad every example to --max_seq_length: the same shapes at every step."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Train on the first N examples only."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on the first N examples only."})
    instruction_column_name: str | None = field(
        default=None, metadata={"help": "The data's column that holds the instruction (default: instruction)."}
    )
    input_column_name: str | None = field(
        default=None, metadata={"help": "The data's column that holds the optional input (default: input)."}
    )
    output_column_name: str | None = field(
        default=None, metadata={"help": "The data's column that holds the response (default: output)."}
    )
    chat_prompt: bool = field(
        default=False,
        metadata={
            "help": "Put each instruction (and its input) in the model's chat template as the user's turn, instead of "
            "the '### Instruction:' prompt."
        },
    )
    sql_prompt: bool = field(
        default=False,
        metadata={
            "help": "Text-to-SQL data: question/context/answer columns (unless the column options say otherwise) in "
            "a SQL prompt."
        },
    )
    overwrite_cache: bool = field(default=False, metadata={"help": "Tokenize again instead of using datasets' cache."})
    keep_in_memory: bool = field(default=False, metadata={"help": "Load the data into memory, not memory-mapped."})
    dataset_seed: int | None = field(
        default=None, metadata={"help": "Seed of the validation split (default: --seed)."}
    )
    dataset_cache_directory: str | None = field(
        default=None, metadata={"help": "Where datasets caches the processed data (HF_DATASETS_CACHE here)."}
    )
    keep_linebreaks: bool = field(
        default=False,
        metadata={"help": "Keep each .txt line's line break in its text (Optimum-Habana's default is True)."},
    )


@dataclass
class LoraArguments:
    lora_rank: int = field(default=8, metadata={"help": "Rank of the LoRA update matrices."})
    lora_alpha: float = field(
        default=16, metadata={"help": "LoRA scaling numerator (the update is scaled by alpha/r)."}
    )
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch's input."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Modules that get adapters; default: the model's attention projections (q_proj k_proj v_proj "
            "o_proj, or qkv_proj o_proj for Phi3)."
        },
    )


@dataclass
class GenerationArguments:
    generation_samples: int = field(
        default=0,
        metadata={
            "help": "After training, greedily complete this many validation prompts (with the attention flags) and "
            "write them to OUTPUT_DIR/generations.json."
        },
    )
    max_new_tokens: int = field(default=32, metadata={"help": "Tokens generated per prompt for --generation_samples."})


@dataclass
class OutputArguments:
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Write into a non-empty --output_dir, replacing an earlier run's files; without it (or "
            "--resume_from_checkpoint) the script refuses, so that no adapter is ever lost silently."
        },
    )
    save_last_ckpt: bool = field(
        default=True,
        metadata={
            "help": "Save the adapter at the end of training (False: keep only the --save_strategy checkpoints)."
        },
    )
    explain: bool = field(
        default=False,
        metadata={
            "help": "Print how each training sequence is laid out over the processes and which attention each one "
            "runs per group of layers, then exit: no weights are loaded, nothing is trained or written."
        },
    )


ARGUMENT_CLASSES = (
    ModelArguments,
    DataArguments,
    LoraArguments,
    PeftArguments,
    AttentionArguments,
    GenerationArguments,
    OutputArguments,
    GaudiTrainingArguments,
)


@dataclass
class Arguments:
    """The parsed command line, one dataclass per group."""

    model: ModelArguments
    data: DataArguments
    lora: LoraArguments
    peft: PeftArguments
    attention: Any  # AttentionArguments
    generation: GenerationArguments
    output: OutputArguments
    gaudi: GaudiTrainingArguments
    training: TrainingArguments
    notes: list[str] = field(default_factory=list)  # what options given for Gaudi or for launchers do here


def parse_arguments(parser: HfArgumentParser, argv: list[str]) -> Arguments:
    """The command line as dataclasses; every usage problem in one message, the unknown arguments first.

    TrainingArguments checks its values while it is built (bf16 on a machine without GPU, say), which would
    otherwise speak before the unknown arguments of a command line written for another tool.
    """
    as_given, unknown = parser.parse_known_args(argv)
    check_environment(parser.prog)
    problems = [f"unrecognized arguments: {' '.join(unknown)}"] if unknown else []
    notes: list[str] = []
    try:  # before TrainingArguments, which reads the DeepSpeed and FSDP files in its constructor
        argv, notes = prepare_sharding_arguments(argv, launch_environment())
    except ValueError as error:
        usage_error(parser, "; ".join([*problems, str(error)]))
    try:
        *groups, _ = parser.parse_args_into_dataclasses(
            args=argv, look_for_args_file=False, return_remaining_strings=True
        )
    except ValueError as error:  # TrainingArguments' own checks
        problems.append(str(error).strip())
    if not problems:
        arguments = Arguments(*groups, notes=notes)
        # Optimum-Habana's --attn_implementation is another way to say --use_flash_attention (or --use-flash-attention).
        given = any(token.split("=")[0].replace("-", "_") == "__use_flash_attention" for token in argv)
        try:
            arguments.attention.use_flash_attention = attention_flag_from(
                arguments.gaudi, arguments.attention.use_flash_attention, given
            )
        except ValueError as error:
            problems.append(str(error))
        try:  # as given: TrainingArguments turns --torch_compile on by itself when a backend is named
            check_compile_backend(
                arguments.training.torch_compile_backend, bool(as_given.torch_compile), allowed=trainer_backends()
            )
        except ValueError as error:
            problems.append(str(error))
    if problems:
        usage_error(parser, "; ".join(problems))
    return arguments


def trainer_backends() -> set[str]:
    """The backends the Trainer can hand accelerate (its DynamoBackend), by torch.compile's names."""
    from accelerate.utils import DynamoBackend

    return {backend.value.lower() for backend in DynamoBackend} - {"no"}


def gaudi_options(args: Arguments) -> list[str]:
    """Optimum-Habana's options checked and applied; returns the lines that say what the others do here."""
    training_args = args.training
    try:
        check_gaudi_training_arguments(args.gaudi)
        dtype = resolve_dtype(args.model.torch_dtype, training_args)
        notes = [*args.notes, *apply_gaudi_training_arguments(args.gaudi, training_args, training_args.device, dtype)]
    except ValueError as error:
        raise FineTuningError(str(error)) from None
    if args.model.low_cpu_mem_usage:
        notes.append("--low_cpu_mem_usage: transformers 5 always loads weights this way; nothing to change.")
    if not args.output.save_last_ckpt and training_args.do_train:
        notes.append("--save_last_ckpt False: the final adapter is not saved; only --save_strategy's checkpoints are.")
    return notes


def check_numbers(args: Arguments) -> None:
    """nan/inf in any float argument and seeds out of range, before anything is loaded."""
    try:
        check_finite_numbers(args.model, args.data, args.lora, args.generation, args.training)
        check_seed(args.training.seed, "--seed")
        check_seed(args.training.data_seed, "--data_seed")
    except ValueError as error:
        raise FineTuningError(str(error)) from None


def check_arguments(
    data_args: DataArguments, generation_args: GenerationArguments, training_args: TrainingArguments
) -> None:
    """Values the parser accepts but that cannot work; each is a FineTuningError naming the flag."""
    if data_args.padding_free and data_args.dataset_concatenation:
        raise FineTuningError(
            "--padding_free and --dataset_concatenation both pack the examples: --padding_free keeps each example "
            "to itself, --dataset_concatenation lets them attend across boundaries. Choose one."
        )
    if data_args.pad_to_max_length and data_args.padding_free:
        raise FineTuningError(
            "--pad_to_max_length and --padding_free contradict each other: one pads every example, the other "
            "removes all padding. Choose one."
        )
    for name in ("max_train_samples", "max_eval_samples"):
        if getattr(data_args, name) is not None and getattr(data_args, name) < 1:
            raise FineTuningError(f"--{name} must be at least 1, got {getattr(data_args, name)}.")
    if data_args.max_seq_length < 1:
        raise FineTuningError(f"--max_seq_length must be at least 1, got {data_args.max_seq_length}.")
    if generation_args.generation_samples < 0:
        raise FineTuningError(f"--generation_samples must be 0 or more, got {generation_args.generation_samples}.")
    if generation_args.max_new_tokens < 1:
        raise FineTuningError(f"--max_new_tokens must be at least 1, got {generation_args.max_new_tokens}.")
    if not (training_args.do_train or training_args.do_eval or generation_args.generation_samples):
        raise FineTuningError("Nothing to do: pass --do_train, --do_eval and/or --generation_samples N.")
    check_trainer_values(training_args)
    if training_args.do_train:
        check_training_length(training_args)
    if problem := data_parallel_launch_problem(training_args.use_cpu, launch_environment()):
        raise FineTuningError(problem)


def check_trainer_values(training_args: TrainingArguments) -> None:
    """Values TrainingArguments accepts and PyTorch refuses only once the model is loaded, deep in the optimizer or the
    data loader (an evaluation batch size of 0 after the whole training), or that train nothing without a word (a
    negative --gradient_accumulation_steps: zero steps, an untrained adapter saved as the result)."""
    evaluates = training_args.do_eval or training_args.eval_strategy != "no"
    at_least_one = {
        "per_device_train_batch_size": training_args.do_train,
        "gradient_accumulation_steps": training_args.do_train,
        "per_device_eval_batch_size": evaluates,
    }
    for name, used in at_least_one.items():
        if used and getattr(training_args, name) < 1:
            raise FineTuningError(f"--{name} must be at least 1, got {getattr(training_args, name)}.")
    if training_args.do_train and training_args.learning_rate <= 0:
        raise FineTuningError(
            f"--learning_rate must be above 0, got {training_args.learning_rate:g}"
            + (": 0 leaves the adapter as it starts." if training_args.learning_rate == 0 else ".")
        )
    if training_args.dataloader_num_workers < 0:
        raise FineTuningError(
            f"--dataloader_num_workers must be 0 (load in the main process) or more, got "
            f"{training_args.dataloader_num_workers}."
        )
    if not training_args.do_train:
        return
    for name in ("weight_decay", "adam_epsilon"):
        if getattr(training_args, name) < 0:
            raise FineTuningError(f"--{name} must be 0 or more, got {getattr(training_args, name):g}.")
    if "adam" in getattr(training_args.optim, "value", str(training_args.optim)):
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(training_args, name) < 1:
                raise FineTuningError(f"--{name} must be in [0, 1), got {getattr(training_args, name):g}.")


def check_training_length(training_args: TrainingArguments) -> None:
    """Step counts the Trainer accepts but that train nothing or save nothing, without a word.

    In transformers, a negative --max_steps (-1, the default) means "train for --num_train_epochs"; 0 means zero
    steps. A --save_steps below 1 is a fraction of the training's steps, and 0 (or less) rounds to no checkpoint.
    """
    if training_args.max_steps == 0:
        raise FineTuningError(
            "--max_steps 0 trains no step: pass a positive number of steps, or leave it out (-1) to train for "
            "--num_train_epochs."
        )
    if training_args.max_steps < 0 and training_args.num_train_epochs <= 0:
        raise FineTuningError(
            f"--num_train_epochs {training_args.num_train_epochs:g} trains no step: pass a positive number of epochs "
            "(0.5 trains on half the data), or --max_steps N."
        )
    if training_args.save_strategy == "steps" and training_args.save_steps <= 0:
        raise FineTuningError(
            f"--save_steps {training_args.save_steps:g} never saves a checkpoint (--save_strategy steps, the "
            "default): pass a positive number of steps (or a fraction below 1 of the training's steps), or "
            "--save_strategy no to save none."
        )


def resolve_dtype(name: str, training_args: TrainingArguments) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if training_args.bf16 else torch.float32
    return DTYPES[name]


def usage_error(parser: HfArgumentParser, message: str) -> NoReturn:
    """Exit with status 2 and the message only: the full usage of TrainingArguments would bury it."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")
