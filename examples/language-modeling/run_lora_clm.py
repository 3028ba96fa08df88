#!/usr/bin/env python
"""LoRA fine-tuning of a causal LM (any supported family) with the Gaudi attention, on transformers' Trainer and PEFT.

    python examples/language-modeling/run_lora_clm.py --output_dir outputs/lora --do_train --do_eval \
        --use_flash_attention --max_steps 40 --learning_rate 1e-3 --per_device_train_batch_size 8

With no --model_name_or_path it fine-tunes the embedded SmolLM2-135M-Instruct; with no --train_file, on the
shipped examples/language-modeling/data/instructions.jsonl. The adapter is saved to --output_dir, where
`examples/text-generation/run_generation.py --peft_model DIR` picks it up. See docs/fine_tuning.md.

Nothing is lost: a non-empty --output_dir is refused unless --overwrite_output_dir or --resume_from_checkpoint
(True: the last complete checkpoint) says what to do with it, and final files are written atomically. Bad input
exits with status 2, a non-finite loss or out of memory with 1, Ctrl-C with 130: one line each ("Failure
behaviour" in docs/fine_tuning.md).

The attention flags are set on the model's generation config before PEFT wraps it, so every forward of training,
evaluation and the final generation uses them, with or without --gradient_checkpointing (which forces the fused
kernel's recompute on), and the Trainer never passes them as arguments.
"""

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from transformers import (
    HfArgumentParser,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from optimum.habana.example_support import adapters, distributed, failures, finetuning, outputs, run_record
from optimum.habana.example_support.arguments import AttentionArguments, check_finite_numbers, check_seed
from optimum.habana.example_support.gaudi_training_arguments import (
    GaudiTrainingArguments,
    ThroughputAfterWarmup,
    apply_gaudi_training_arguments,
    attention_flag_from,
    check_gaudi_training_arguments,
)
from optimum.habana.utils import devices
from optimum.habana.utils.atomic import atomic_write_text
from optimum.habana.utils.distributed import launch_environment
from optimum.habana.utils.model_loading import ModelResolutionError, resolve_model
from optimum.habana.utils.pretrained import load_model_and_tokenizer


logger = logging.getLogger(__name__)

DEFAULT_TRAIN_FILE = Path(__file__).resolve().parent / "data" / "instructions.jsonl"
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
        default=512, metadata={"help": "Longest tokenized example (or packed block with --dataset_concatenation)."}
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


ARGUMENT_CLASSES = (
    ModelArguments,
    DataArguments,
    LoraArguments,
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
    attention: Any  # AttentionArguments
    generation: GenerationArguments
    output: OutputArguments
    gaudi: GaudiTrainingArguments
    training: TrainingArguments


@dataclass
class Progress:
    """Where the run is, for the one line printed on Ctrl-C or out of memory."""

    phase: str = "starting"
    output_dir: Path | None = None
    checkpoints_before: set[str] = field(default_factory=set)
    published: list[str] = field(default_factory=list)


def main(argv: Sequence[str] | None = None, callbacks: list[TrainerCallback] | None = None) -> dict[str, Any]:
    """Fine-tune, evaluate, save the adapter; returns the metrics (also in OUTPUT_DIR/all_results.json).

    A usage problem (bad argument, unusable data file, model, output folder or checkpoint) exits with status 2
    and a one-line message, before the model loads wherever it can be checked without it. A non-finite training
    loss or running out of memory exits with status 1, Ctrl-C with 130: one line each, and nothing half-written.
    """
    parser = HfArgumentParser((*ARGUMENT_CLASSES, TrainingArguments), prog=Path(__file__).name)
    args = parse_arguments(parser, sys.argv[1:] if argv is None else list(argv))
    progress = Progress()
    with failures.exit_on_interrupt_or_oom(
        parser.prog,
        on_interrupt=lambda: interrupted_message(progress),
        on_out_of_memory=lambda error: out_of_memory_message(progress, error, args),
        cleanup=lambda: remove_partial_checkpoints(progress),
    ):
        return run(parser, args, progress, callbacks)


def parse_arguments(parser: HfArgumentParser, argv: list[str]) -> Arguments:
    """The command line as dataclasses; every usage problem in one message, the unknown arguments first.

    TrainingArguments checks its values while it is built (bf16 on a machine without GPU, say), which would
    otherwise speak before the unknown arguments of a command line written for another tool.
    """
    _, unknown = parser.parse_known_args(argv)
    problems = [f"unrecognized arguments: {' '.join(unknown)}"] if unknown else []
    try:
        *groups, _ = parser.parse_args_into_dataclasses(
            args=argv, look_for_args_file=False, return_remaining_strings=True
        )
    except ValueError as error:  # TrainingArguments' own checks
        problems.append(str(error).strip())
    if not problems:
        arguments = Arguments(*groups)
        # Optimum-Habana's --attn_implementation is another way to say --use_flash_attention.
        given = any(token.split("=")[0] == "--use_flash_attention" for token in argv)
        try:
            arguments.attention.use_flash_attention = attention_flag_from(
                arguments.gaudi, arguments.attention.use_flash_attention, given
            )
        except ValueError as error:
            problems.append(str(error))
    if problems:
        usage_error(parser, "; ".join(problems))
    return arguments


def run(
    parser: HfArgumentParser, args: Arguments, progress: Progress, callbacks: list[TrainerCallback] | None
) -> dict[str, Any]:
    model_args, data_args, lora_args, attention_args = args.model, args.data, args.lora, args.attention
    generation_args, output_args, training_args = args.generation, args.output, args.training
    try:
        check_numbers(args)
        flags = finetuning.attention_flags_from(attention_args)
        notes = gaudi_options(args)
        check_arguments(data_args, generation_args, training_args)
        resume = outputs.parse_resume_value(training_args.resume_from_checkpoint)
        outputs.check_overwrite_and_resume(output_args.overwrite_output_dir, resume, training_args.output_dir)
        # Under torchrun one process at a time: another's write probe would make the folder look non-empty.
        with training_args.main_process_first(desc="checking the output folder"):
            output_dir = outputs.prepare_output_dir(
                training_args.output_dir, overwrite=output_args.overwrite_output_dir, resuming=resume is not None
            )
            if output_args.overwrite_output_dir and training_args.should_save:
                outputs.remove_earlier_checkpoints(output_dir)
        progress.output_dir = output_dir
        progress.phase = "loading the model"
        # Under torchrun the first process of each machine resolves (converts a .gguf once); the others then load.
        with training_args.main_process_first(local=True, desc="resolving the model"):
            resolved = resolve_model(model_args.model_name_or_path)
        finetuning.check_max_seq_length(data_args.max_seq_length, resolved)
        if data_args.train_file is None and data_args.dataset_name is None:
            data_args.train_file = str(DEFAULT_TRAIN_FILE)
        train_file = data_args.train_file
        arguments_of_this_run = run_record.run_arguments(model_args, data_args, lora_args, training_args)
        checkpoint = outputs.resolve_checkpoint(resume, output_dir)
        if checkpoint is not None:
            if not training_args.do_train:
                raise finetuning.FineTuningError("--resume_from_checkpoint continues a training: pass --do_train.")
            adapters.check_adapter_folder(checkpoint, "--resume_from_checkpoint")
            if problem := run_record.resume_problem(checkpoint, arguments_of_this_run):
                raise finetuning.FineTuningError(f"--resume_from_checkpoint: {problem}")
        progress.phase = "loading the data"
        raw_datasets, data_format = finetuning.load_raw_datasets(
            train_file=train_file,
            validation_file=data_args.validation_file,
            dataset_name=data_args.dataset_name,
            dataset_config_name=data_args.dataset_config_name,
            validation_split_percentage=data_args.validation_split_percentage,
            seed=training_args.seed,
        )
        if training_args.do_eval and "validation" not in raw_datasets:
            raise finetuning.FineTuningError(
                "--do_eval needs validation data: pass --validation_file or a --validation_split_percentage above 0."
            )
        lora_config = finetuning.lora_config(
            rank=lora_args.lora_rank,
            alpha=lora_args.lora_alpha,
            dropout=lora_args.lora_dropout,
            target_modules=lora_args.lora_target_modules,
        )
        set_seed(training_args.seed)
        dtype = resolve_dtype(model_args.torch_dtype, training_args)
        progress.phase = "loading the model"
        from_pretrained = (
            {"attn_implementation": args.gaudi.attn_implementation} if args.gaudi.attn_implementation else {}
        )
        loaded = load_model_and_tokenizer(
            model_args.model_name_or_path,
            dtype=dtype,
            device=training_args.device,
            resolved=resolved,
            **from_pretrained,
        )
        model, tokenizer = loaded.model, loaded.tokenizer
        # Before PEFT wraps the model: its forward reads the flags from here on every call.
        finetuning.set_attention_flags(model, flags)
        model = finetuning.add_lora(model, lora_config)
        if checkpoint is not None:
            adapters.check_adapter_matches(checkpoint, model, "--resume_from_checkpoint")
    except (finetuning.FineTuningError, ModelResolutionError, outputs.OutputDirError, adapters.AdapterError) as error:
        usage_error(parser, str(error))

    logger.info("Model: %s, %s, attention flags %s", loaded.resolved.description, dtype, flags)
    for note in notes if training_args.local_process_index == 0 else ():
        logger.warning(note)
    if (bf16_note := devices.slow_bf16_note(training_args.device, dtype)) and training_args.local_process_index == 0:
        logger.warning("--bf16 / --torch_dtype bfloat16: %s", bf16_note)
    if training_args.local_process_index == 0:
        model.print_trainable_parameters()

    progress.phase = "tokenizing"
    tokenizer.padding_side = "right"  # training batches: real tokens first, so positions start at 0
    datasets = {}
    for split, dataset in raw_datasets.items():
        with training_args.main_process_first(desc=f"tokenizing {split}"):
            tokenized = finetuning.tokenize_dataset(
                dataset,
                tokenizer,
                data_format,
                None if data_args.dataset_concatenation else data_args.max_seq_length,
                train_on_inputs=args.gaudi.train_on_inputs,
            )
            if data_args.dataset_concatenation:
                tokenized = finetuning.pack_sequences(tokenized, data_args.max_seq_length)
        if tokenized.num_rows == 0:
            usage_error(
                parser,
                f"No {split} example keeps a token to learn within --max_seq_length {data_args.max_seq_length}: "
                "raise --max_seq_length.",
            )
        datasets[split] = tokenized
    logger.info("Data: %s, %s", data_format, {split: dataset.num_rows for split, dataset in datasets.items()})

    throughput = ThroughputAfterWarmup(args.gaudi.throughput_warmup_steps)
    trainer = finetuning.FiniteLossTrainer(
        model=model,
        args=training_args,
        train_dataset=datasets["train"] if training_args.do_train else None,
        eval_dataset=datasets.get("validation") if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=finetuning.data_collator(tokenizer, padding_free=data_args.padding_free),
        # Saved in every checkpoint, so that a resume can tell this run's checkpoints from another run's.
        callbacks=[run_record.RunArguments(**arguments_of_this_run), throughput, *(callbacks or [])],
    )
    device = training_args.device
    metrics: dict[str, Any] = {}

    if training_args.do_train:
        progress.phase = "training"
        progress.checkpoints_before = {path.name for path in outputs.checkpoints(output_dir)}
        devices.reset_peak_memory(device)
        try:
            train_result = trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
        except finetuning.NonFiniteLossError as error:
            remove_partial_checkpoints(progress)
            runtime_error(
                parser,
                f"{error}: training stopped and this run's adapter was not saved. Lower --learning_rate, check "
                "--lora_alpha and the training data, or train in float32 (no --bf16/--fp16).",
            )
        devices.synchronize(device)
        train_metrics = {**train_result.metrics, "train_peak_memory_gb": peak_memory_gb(device)}
        if args.gaudi.throughput_warmup_steps:
            warmup_steps = args.gaudi.throughput_warmup_steps
            samples_per_step = training_args.train_batch_size * training_args.gradient_accumulation_steps
            after_warmup = throughput.samples_per_second(
                trainer.state.global_step, samples_per_step * training_args.world_size
            )
            if after_warmup is None:
                logger.warning(
                    "--throughput_warmup_steps %d: training ended within the warm-up steps; train_samples_per_second "
                    "covers every step.",
                    warmup_steps,
                )
            else:
                train_metrics["train_samples_per_second"] = after_warmup
        train_metrics["train_samples"] = datasets["train"].num_rows
        trainer.log_metrics("train", train_metrics)
        metrics.update(train_metrics)
        progress.phase = "saving the adapter"
        with outputs.publishing(output_dir) as staging:
            trainer.save_model(str(staging))  # the LoRA adapter and the tokenizer, for run_generation.py --peft_model
            if trainer.is_world_process_zero():
                trainer.state.save_to_json(str(staging / "trainer_state.json"))
                write_metrics(staging, "train", train_metrics, metrics)
        progress.published.append("the adapter")

    if training_args.do_eval:
        progress.phase = "evaluating"
        devices.reset_peak_memory(device)
        eval_metrics = trainer.evaluate()
        eval_metrics["perplexity"] = finetuning.perplexity(eval_metrics["eval_loss"])
        eval_metrics["eval_peak_memory_gb"] = peak_memory_gb(device)
        eval_metrics["eval_samples"] = datasets["validation"].num_rows
        trainer.log_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
        if trainer.is_world_process_zero():
            with outputs.publishing(output_dir) as staging:
                write_metrics(staging, "eval", eval_metrics, metrics)
        progress.published.append("the evaluation results")

    if generation_args.generation_samples > 0:
        progress.phase = "generating samples"
        generations = generate_samples(model, tokenizer, raw_datasets, data_format, generation_args)
        if trainer.is_world_process_zero():
            atomic_write_text(output_dir / "generations.json", json.dumps(generations, indent=2) + "\n")
        metrics["generations"] = generations

    if trainer.is_world_process_zero():
        print(summary(metrics, flags.use_flash_attention, training_args))
    return metrics


def gaudi_options(args: Arguments) -> list[str]:
    """Optimum-Habana's options checked and applied; returns the lines that say what the others do here."""
    training_args = args.training
    try:
        check_gaudi_training_arguments(args.gaudi)
        dtype = resolve_dtype(args.model.torch_dtype, training_args)
        return apply_gaudi_training_arguments(args.gaudi, training_args, training_args.device, dtype)
    except ValueError as error:
        raise finetuning.FineTuningError(str(error)) from None


def check_numbers(args: Arguments) -> None:
    """nan/inf in any float argument and seeds out of range, before anything is loaded."""
    try:
        check_finite_numbers(args.model, args.data, args.lora, args.generation, args.training)
        check_seed(args.training.seed, "--seed")
        check_seed(args.training.data_seed, "--data_seed")
    except ValueError as error:
        raise finetuning.FineTuningError(str(error)) from None


def check_arguments(
    data_args: DataArguments, generation_args: GenerationArguments, training_args: TrainingArguments
) -> None:
    """Values the parser accepts but that cannot work; each is a FineTuningError naming the flag."""
    if data_args.padding_free and data_args.dataset_concatenation:
        raise finetuning.FineTuningError(
            "--padding_free and --dataset_concatenation both pack the examples: --padding_free keeps each example "
            "to itself, --dataset_concatenation lets them attend across boundaries. Choose one."
        )
    if data_args.max_seq_length < 1:
        raise finetuning.FineTuningError(f"--max_seq_length must be at least 1, got {data_args.max_seq_length}.")
    if generation_args.generation_samples < 0:
        raise finetuning.FineTuningError(
            f"--generation_samples must be 0 or more, got {generation_args.generation_samples}."
        )
    if generation_args.max_new_tokens < 1:
        raise finetuning.FineTuningError(f"--max_new_tokens must be at least 1, got {generation_args.max_new_tokens}.")
    if not (training_args.do_train or training_args.do_eval or generation_args.generation_samples):
        raise finetuning.FineTuningError("Nothing to do: pass --do_train, --do_eval and/or --generation_samples N.")
    if problem := distributed.data_parallel_launch_problem(training_args.use_cpu, launch_environment()):
        raise finetuning.FineTuningError(problem)


def write_metrics(folder: Path, split: str, split_metrics: dict[str, Any], run_metrics: dict[str, Any]) -> None:
    """`<split>_results.json` and `all_results.json` (this run's metrics so far), as Trainer.save_metrics names them."""
    atomic_write_text(folder / f"{split}_results.json", json.dumps(split_metrics, indent=4, sort_keys=True) + "\n")
    atomic_write_text(folder / "all_results.json", json.dumps(run_metrics, indent=4, sort_keys=True) + "\n")


def remove_partial_checkpoints(progress: Progress) -> None:
    """The checkpoint folder this run was writing when it stopped, if any: no resume could use it."""
    if progress.output_dir is not None and progress.phase == "training":
        outputs.remove_incomplete_checkpoints(progress.output_dir, keep=progress.checkpoints_before)


def interrupted_message(progress: Progress) -> str:
    """What Ctrl-C stopped, and what is kept: whole files only, and the way to continue."""
    kept = f"{' and '.join(progress.published)} of this run saved; " if progress.published else ""
    complete = None if progress.output_dir is None else outputs.last_complete_checkpoint(progress.output_dir)
    if complete is not None:
        then = f"continue from {complete.name} with --resume_from_checkpoint True"
    elif progress.published:
        then = "nothing else was written"
    else:
        then = f"nothing was written to {progress.output_dir or 'the output folder'}; run the same command again"
    return f"Ctrl-C while {progress.phase}: {kept}{then}."


def out_of_memory_message(progress: Progress, error: BaseException, args: Arguments) -> str:
    """What ran out, with the batch and lengths that did it, and what to lower."""
    data_args, generation_args, training_args = args.data, args.generation, args.training
    device = training_args.device.type
    if progress.phase == "evaluating":
        sizes = f"--per_device_eval_batch_size {training_args.per_device_eval_batch_size}"
    elif progress.phase == "generating samples":
        sizes = f"--generation_samples {generation_args.generation_samples}, --max_new_tokens {generation_args.max_new_tokens}"
    else:
        sizes = f"--per_device_train_batch_size {training_args.per_device_train_batch_size}"
    sizes += f", --max_seq_length {data_args.max_seq_length}"
    return (
        f"out of memory on {device} while {progress.phase} ({sizes}; {type(error).__name__}). Lower the batch size "
        "or --max_seq_length, or add --gradient_checkpointing."
    )


def resolve_dtype(name: str, training_args: TrainingArguments) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if training_args.bf16 else torch.float32
    return DTYPES[name]


def generate_samples(
    model: torch.nn.Module,
    tokenizer: Any,
    raw_datasets: Any,
    data_format: finetuning.DataFormat,
    generation_args: GenerationArguments,
) -> list[dict[str, str]]:
    """Complete the first validation (else training) prompts: a quick look at what the fine-tuning did."""
    source = raw_datasets["validation"] if "validation" in raw_datasets else raw_datasets["train"]
    rows = source.select(range(min(generation_args.generation_samples, source.num_rows)))
    if data_format == "instruction":
        prompts = [finetuning.build_prompt(row["instruction"], row.get("input")) for row in rows]
        references = [str(row["output"]) for row in rows]
    else:
        # Plain text: the first half of each line is the prompt, the rest the reference.
        texts = [str(row[finetuning.TEXT_FIELD]) for row in rows]
        prompts = [text[: len(text) // 2] for text in texts]
        references = [text[len(text) // 2 :] for text in texts]
    completions = finetuning.complete_prompts(model, tokenizer, prompts, generation_args.max_new_tokens)
    return [
        {"prompt": prompt, "completion": completion, "reference": reference}
        for prompt, completion, reference in zip(prompts, completions, references, strict=True)
    ]


def peak_memory_gb(device: torch.device) -> float:
    """Peak since the last reset: device memory on HPU/CUDA, the process's peak resident set on CPU."""
    return round(devices.memory_stats(device)["max_allocated"] / 1e9, 3)


def summary(metrics: dict[str, Any], use_flash_attention: bool, training_args: TrainingArguments) -> str:
    parts = [f"use_flash_attention={use_flash_attention}"]
    if training_args.world_size > 1:  # the Trainer's loss and samples/s cover every process; memory is rank 0's
        parts.append(f"{training_args.world_size} processes (data parallel)")
    if "train_loss" in metrics:
        parts += [
            f"train loss {metrics['train_loss']:.4f}",
            f"{metrics['train_samples_per_second']:.2f} samples/s",
            f"train peak memory {metrics['train_peak_memory_gb']:.2f} GB",
        ]
    if "eval_loss" in metrics:
        parts += [f"eval loss {metrics['eval_loss']:.4f}", f"perplexity {metrics['perplexity']:.2f}"]
    if training_args.do_train:
        parts.append(f"adapter saved to {training_args.output_dir}")
    return "; ".join(parts)


def usage_error(parser: HfArgumentParser, message: str) -> NoReturn:
    """Exit with status 2 and the message only: the full usage of TrainingArguments would bury it."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def runtime_error(parser: HfArgumentParser, message: str) -> NoReturn:
    """Exit with status 1: the run itself failed (not the command line), with the message only."""
    parser.exit(failures.EXIT_FAILURE, f"{parser.prog}: error: {message}\n")


if __name__ == "__main__":
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    main(sys.argv[1:])
