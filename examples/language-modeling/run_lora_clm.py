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
    AutoConfig,
    HfArgumentParser,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from optimum.habana.cli import adapters, common
from optimum.habana.cli.finetuning import (
    checkpoints,
    data,
    loading_options,
    modeling,
    peft_methods,
    run_record,
    sharding,
)
from optimum.habana.cli.finetuning.arguments import (
    ARGUMENT_CLASSES,
    Arguments,
    GenerationArguments,
    check_arguments,
    check_numbers,
    gaudi_options,
    parse_arguments,
    resolve_dtype,
    usage_error,
)
from optimum.habana.cli.finetuning.errors import FineTuningError
from optimum.habana.cli.finetuning.gaudi_arguments import GaudiTrainingArguments, ThroughputAfterWarmup
from optimum.habana.cli.finetuning.prompts import DataFormat, build_styled_prompt
from optimum.habana.cli.finetuning.sharding import explain_training
from optimum.habana.cli.finetuning.trainer import (
    FiniteLossTrainer,
    NonFiniteLossError,
    next_token_accuracy,
    next_token_predictions,
)
from optimum.habana.transformers.context_parallel import ContextParallelError
from optimum.habana.transformers.context_parallel.trainer import check_context_parallel_model
from optimum.habana.utils import devices
from optimum.habana.utils.atomic import atomic_write_text
from optimum.habana.utils.model_loading import ModelResolutionError, resolve_model
from optimum.habana.utils.pretrained import load_model_and_tokenizer


logger = logging.getLogger(__name__)

DEFAULT_TRAIN_FILE = Path(__file__).resolve().parent / "data" / "instructions.jsonl"


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
    with common.exit_on_interrupt_or_oom(
        parser.prog,
        on_interrupt=lambda: interrupted_message(progress),
        on_out_of_memory=lambda error: out_of_memory_message(progress, error, args),
        cleanup=lambda: remove_partial_checkpoints(progress),
    ):
        return run(parser, args, progress, callbacks)


def run(
    parser: HfArgumentParser, args: Arguments, progress: Progress, callbacks: list[TrainerCallback] | None
) -> dict[str, Any]:
    model_args, data_args, lora_args, attention_args = args.model, args.data, args.lora, args.attention
    generation_args, output_args, training_args = args.generation, args.output, args.training
    if output_args.explain:
        return explain_run(parser, args)
    schedules: list[TrainerCallback] = []  # callbacks that adjust the training schedule
    try:
        check_numbers(args)
        peft_methods.check_peft_arguments(args.peft, lora_args)
        flags = modeling.attention_flags_from(attention_args)
        notes = gaudi_options(args)
        check_arguments(data_args, generation_args, training_args)
        prompt_style = loading_options.prompt_style(data_args)
        loading_options.apply_sql_columns(data_args)
        resume = checkpoints.parse_resume_value(training_args.resume_from_checkpoint)
        checkpoints.check_overwrite_and_resume(output_args.overwrite_output_dir, resume, training_args.output_dir)
        # Under torchrun one process at a time: another's write probe would make the folder look non-empty.
        with training_args.main_process_first(desc="checking the output folder"):
            output_dir = common.prepare_output_dir(
                training_args.output_dir,
                overwrite=output_args.overwrite_output_dir,
                resuming=checkpoints.continues_the_run_in(resume, training_args.output_dir),
            )
            if output_args.overwrite_output_dir and training_args.should_save:
                checkpoints.remove_earlier_checkpoints(output_dir)
        progress.output_dir = output_dir
        progress.phase = "loading the model"
        # Under torchrun the first process of each machine resolves (converts a .gguf once); the others then load.
        with training_args.main_process_first(local=True, desc="resolving the model"):
            resolved = resolve_model(model_args.model_name_or_path, **loading_options.hub_options(model_args))
        data.check_max_seq_length(data_args.max_seq_length, resolved)
        config = loading_options.load_config_override(model_args.config_name, model_args.token)
        loading_options.check_config_fits(config, resolved.path)
        tokenizer_override = loading_options.load_tokenizer_override(model_args.tokenizer_name, model_args.token)
        notes += loading_options.loading_notes(model_args, data_args, resolved)
        model_config = config or AutoConfig.from_pretrained(resolved.path)
        peft_methods.check_model_supports(args.peft, model_config)
        check_context_parallel_model(
            model_config,
            args.gaudi.context_parallel_size,
            "--context_parallel_size",
            packed_by="--padding_free" if data_args.padding_free else None,
        )
        if data_args.padding_free:
            data.check_padding_free_model(model_config)
        if data_args.train_file is None and data_args.dataset_name is None:
            data_args.train_file = str(DEFAULT_TRAIN_FILE)
        train_file = data_args.train_file
        arguments_of_this_run = run_record.run_arguments(model_args, data_args, lora_args, args.peft, training_args)
        checkpoint = checkpoints.resolve_checkpoint(resume, output_dir)
        if checkpoint is not None:
            if not training_args.do_train:
                raise FineTuningError("--resume_from_checkpoint continues a training: pass --do_train.")
            adapters.check_adapter_folder(checkpoint, "--resume_from_checkpoint")
            if problem := run_record.resume_problem(checkpoint, arguments_of_this_run):
                raise FineTuningError(f"--resume_from_checkpoint: {problem}")
            longer = run_record.resume_notes(checkpoint, arguments_of_this_run)
            notes += longer
            schedules += [run_record.LongerRunSchedule()] if longer else []
        progress.phase = "loading the data"
        raw_datasets, data_format = data.load_raw_datasets(
            train_file=train_file,
            validation_file=data_args.validation_file,
            dataset_name=data_args.dataset_name,
            dataset_config_name=data_args.dataset_config_name,
            validation_split_percentage=data_args.validation_split_percentage,
            seed=training_args.seed if data_args.dataset_seed is None else data_args.dataset_seed,
            columns=data.column_renames(data_args),
            keep_linebreaks=data_args.keep_linebreaks,
            load_options={
                "keep_in_memory": data_args.keep_in_memory,
                **({"cache_dir": model_args.cache_dir} if model_args.cache_dir else {}),
                **({"token": model_args.token} if model_args.token else {}),
            },
        )
        raw_datasets = data.limit_examples(raw_datasets, data_args.max_train_samples, data_args.max_eval_samples)
        if training_args.do_eval and "validation" not in raw_datasets:
            raise FineTuningError(
                "--do_eval needs validation data: pass --validation_file or a --validation_split_percentage above 0."
            )
        set_seed(training_args.seed)
        dtype = resolve_dtype(model_args.torch_dtype, training_args)
        progress.phase = "loading the model"
        from_pretrained = (
            {"attn_implementation": args.gaudi.attn_implementation} if args.gaudi.attn_implementation else {}
        )
        if config is not None:
            from_pretrained["config"] = config
        loaded = load_model_and_tokenizer(
            model_args.model_name_or_path,
            dtype=dtype,
            device=training_args.device,
            resolved=resolved,
            **from_pretrained,
        )
        model, tokenizer = loaded.model, tokenizer_override or loaded.tokenizer
        # Before PEFT wraps the model: its forward reads the flags from here on every call.
        modeling.set_attention_flags(model, flags)
        peft_config = peft_methods.peft_config(args.peft, lora_args, model)
        model = peft_methods.add_adapter(model, peft_config, args.peft.peft_type)
        notes += sharding.match_wrap_classes(training_args, model)
        if checkpoint is not None:
            adapters.check_adapter_matches(checkpoint, model, "--resume_from_checkpoint")
    except (
        FineTuningError,
        ModelResolutionError,
        common.OutputDirError,
        adapters.AdapterError,
    ) as error:
        usage_error(parser, str(error))
    except ValueError as error:  # sharding.match_wrap_classes
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
            tokenized = data.tokenize_dataset(
                dataset,
                tokenizer,
                data_format,
                None if data_args.dataset_concatenation else data_args.max_seq_length,
                train_on_inputs=args.gaudi.train_on_inputs,
                prompt_style=prompt_style,
                load_from_cache_file=False if data_args.overwrite_cache else None,
            )
            if data_args.dataset_concatenation:
                tokenized = data.pack_sequences(tokenized, data_args.max_seq_length)
        if tokenized.num_rows == 0:
            usage_error(
                parser,
                f"No {split} example keeps a token to learn within --max_seq_length {data_args.max_seq_length}: "
                "raise --max_seq_length.",
            )
        datasets[split] = tokenized
    logger.info("Data: %s, %s", data_format, {split: dataset.num_rows for split, dataset in datasets.items()})

    throughput = ThroughputAfterWarmup(args.gaudi.throughput_warmup_steps, adjust=args.gaudi.adjust_throughput)
    schedules += [peft_methods.AdaLoraSchedule()] if args.peft.peft_type == "adalora" else []
    try:  # the processes of a context-parallel run check the fused kernel together
        trainer = FiniteLossTrainer(
            model=model,
            args=training_args,
            train_dataset=datasets["train"] if training_args.do_train else None,
            eval_dataset=datasets.get("validation") if training_args.do_eval else None,
            processing_class=tokenizer,
            data_collator=data.data_collator(
                tokenizer,
                padding_free=data_args.padding_free,
                pad_to=data_args.max_seq_length if data_args.pad_to_max_length else None,
            ),
            compute_metrics=next_token_accuracy if training_args.do_eval else None,
            context_parallel_size=args.gaudi.context_parallel_size,
            preprocess_logits_for_metrics=next_token_predictions if training_args.do_eval else None,
            # Saved in every checkpoint, so that a resume can tell this run's checkpoints from another run's.
            callbacks=[run_record.RunArguments(**arguments_of_this_run), throughput, *schedules, *(callbacks or [])],
        )
    except ContextParallelError as error:
        usage_error(parser, str(error))
    device = training_args.device
    metrics: dict[str, Any] = {}

    if training_args.do_train:
        progress.phase = "training"
        progress.checkpoints_before = {path.name for path in checkpoints.checkpoints(output_dir)}
        devices.reset_peak_memory(device)
        try:
            train_result = trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
        except FineTuningError as error:  # AdaLoraSchedule: the step count is known once training starts
            usage_error(parser, str(error))
        except NonFiniteLossError as error:
            remove_partial_checkpoints(progress)
            runtime_error(
                parser,
                f"{error}: training stopped and this run's adapter was not saved. Lower --learning_rate, check "
                "--lora_alpha and the training data, or train in float32 (no --bf16/--fp16).",
            )
        devices.synchronize(device)
        train_metrics = {**train_result.metrics, "train_peak_memory_gib": peak_memory_gib(device)}
        if args.gaudi.throughput_warmup_steps or args.gaudi.adjust_throughput:
            warmup_steps = args.gaudi.throughput_warmup_steps
            samples_per_step = training_args.train_batch_size * training_args.gradient_accumulation_steps
            after_warmup = throughput.samples_per_second(samples_per_step * training_args.world_size)
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
        with checkpoints.publishing(output_dir) as staging:
            if output_args.save_last_ckpt:  # the LoRA adapter and the tokenizer, for run_generation.py --peft_model
                trainer.save_model(str(staging))
            if trainer.is_world_process_zero():
                trainer.state.save_to_json(str(staging / "trainer_state.json"))
                write_metrics(staging, "train", train_metrics, metrics)
        progress.published.append("the adapter" if output_args.save_last_ckpt else "the training results")

    if training_args.do_eval:
        progress.phase = "evaluating"
        devices.reset_peak_memory(device)
        eval_metrics = trainer.evaluate()
        eval_metrics["perplexity"] = modeling.perplexity(eval_metrics["eval_loss"])
        eval_metrics["eval_peak_memory_gib"] = peak_memory_gib(device)
        eval_metrics["eval_samples"] = datasets["validation"].num_rows
        trainer.log_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
        if trainer.is_world_process_zero():
            with checkpoints.publishing(output_dir) as staging:
                write_metrics(staging, "eval", eval_metrics, metrics)
        progress.published.append("the evaluation results")

    if generation_args.generation_samples > 0:
        progress.phase = "generating samples"
        generations = generate_samples(
            model, tokenizer, raw_datasets, data_format, generation_args, prompt_style=prompt_style
        )
        if trainer.is_world_process_zero():
            atomic_write_text(output_dir / "generations.json", json.dumps(generations, indent=2) + "\n")
        metrics["generations"] = generations

    if trainer.is_world_process_zero():
        print(summary(metrics, flags.use_flash_attention, training_args, output_args.save_last_ckpt, args.gaudi))
    return metrics


def explain_run(parser: HfArgumentParser, args: Arguments) -> dict[str, Any]:
    """--explain: the run's checks, then the layout of the sequences over the processes; nothing is loaded or
    written."""
    try:
        check_numbers(args)
        peft_methods.check_peft_arguments(args.peft, args.lora)
        flags = modeling.attention_flags_from(args.attention)
        gaudi_options(args)
        check_arguments(args.data, args.generation, args.training)
        resume = checkpoints.parse_resume_value(args.training.resume_from_checkpoint)
        checkpoints.check_overwrite_and_resume(args.output.overwrite_output_dir, resume, args.training.output_dir)
        common.check_output_dir(
            args.training.output_dir,
            overwrite=args.output.overwrite_output_dir,
            resuming=checkpoints.continues_the_run_in(resume, args.training.output_dir),
        )
        resolved = resolve_model(args.model.model_name_or_path, **loading_options.hub_options(args.model))
        data.check_max_seq_length(args.data.max_seq_length, resolved)
        config = loading_options.load_config_override(args.model.config_name, args.model.token)
        config = config or AutoConfig.from_pretrained(resolved.path)
        check_context_parallel_model(
            config,
            args.gaudi.context_parallel_size,
            "--context_parallel_size",
            packed_by="--padding_free" if args.data.padding_free else None,
        )
        if args.data.padding_free:
            data.check_padding_free_model(config)
        text = explain_training(
            config,
            context_parallel_size=args.gaudi.context_parallel_size,
            world_size=args.training.world_size,
            max_seq_length=args.data.max_seq_length,
            use_flash_attention=flags.use_flash_attention,
            device=args.training.device,
            dtype=resolve_dtype(args.model.torch_dtype, args.training),
        )
    except (FineTuningError, ModelResolutionError, ValueError) as error:
        usage_error(parser, str(error))
    if args.training.process_index == 0:
        print(f"Model: {resolved.description}\n{text}")
    return {}


def write_metrics(folder: Path, split: str, split_metrics: dict[str, Any], run_metrics: dict[str, Any]) -> None:
    """`<split>_results.json` and `all_results.json` (this run's metrics so far), as Trainer.save_metrics names them."""
    atomic_write_text(folder / f"{split}_results.json", json.dumps(split_metrics, indent=4, sort_keys=True) + "\n")
    atomic_write_text(folder / "all_results.json", json.dumps(run_metrics, indent=4, sort_keys=True) + "\n")


def remove_partial_checkpoints(progress: Progress) -> None:
    """The checkpoint folder this run was writing when it stopped, if any: no resume could use it."""
    if progress.output_dir is not None and progress.phase == "training":
        checkpoints.remove_incomplete_checkpoints(progress.output_dir, keep=progress.checkpoints_before)


def interrupted_message(progress: Progress) -> str:
    """What Ctrl-C stopped, and what is kept: whole files only, and the way to continue."""
    kept = f"{' and '.join(progress.published)} of this run saved; " if progress.published else ""
    complete = None if progress.output_dir is None else checkpoints.last_complete_checkpoint(progress.output_dir)
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


def generate_samples(
    model: torch.nn.Module,
    tokenizer: Any,
    raw_datasets: Any,
    data_format: DataFormat,
    generation_args: GenerationArguments,
    prompt_style: str = "instruction",
) -> list[dict[str, str]]:
    """Complete the first validation (else training) prompts: a quick look at what the fine-tuning did."""
    source = raw_datasets["validation"] if "validation" in raw_datasets else raw_datasets["train"]
    rows = source.select(range(min(generation_args.generation_samples, source.num_rows)))
    if data_format == "instruction":
        prompts = [build_styled_prompt(prompt_style, tokenizer, row["instruction"], row.get("input")) for row in rows]
        references = [str(row["output"]) for row in rows]
    else:
        # Plain text: the first half of each line is the prompt, the rest the reference.
        texts = [str(row[data.TEXT_FIELD]) for row in rows]
        prompts = [text[: len(text) // 2] for text in texts]
        references = [text[len(text) // 2 :] for text in texts]
    completions = modeling.complete_prompts(model, tokenizer, prompts, generation_args.max_new_tokens)
    return [
        {"prompt": prompt, "completion": completion, "reference": reference}
        for prompt, completion, reference in zip(prompts, completions, references, strict=True)
    ]


def peak_memory_gib(device: torch.device) -> float:
    """Peak since the last reset: device memory on HPU/CUDA, the process's peak resident set on CPU."""
    return round(devices.memory_stats(device)["max_allocated"] / 1024**3, 3)


def summary(
    metrics: dict[str, Any],
    use_flash_attention: bool,
    training_args: TrainingArguments,
    save_last_ckpt: bool,
    gaudi: GaudiTrainingArguments,
) -> str:
    parts = [f"use_flash_attention={use_flash_attention}"]
    world_size, split = training_args.world_size, gaudi.context_parallel_size
    if world_size > 1:  # the Trainer's loss and samples/s cover every process; memory is rank 0's
        sharding = "FSDP" if training_args.fsdp else "DeepSpeed" if training_args.deepspeed else "data parallel"
        if split > 1:
            replicas = f", {world_size // split} data-parallel replicas" if world_size > split else ""
            sharding = f"context parallel {split}: each sequence split over {split} processes{replicas}"
        parts.append(f"{world_size} processes ({sharding})")
    if "train_loss" in metrics:
        parts += [
            f"train loss {metrics['train_loss']:.4f}",
            f"{metrics['train_samples_per_second']:.2f} samples/s",
            f"train peak memory {metrics['train_peak_memory_gib']:.2f} GiB",
        ]
    if "eval_loss" in metrics:
        parts += [f"eval loss {metrics['eval_loss']:.4f}", f"perplexity {metrics['perplexity']:.2f}"]
    if training_args.do_train and save_last_ckpt:
        parts.append(f"adapter saved to {training_args.output_dir}")
    return "; ".join(parts)


def runtime_error(parser: HfArgumentParser, message: str) -> NoReturn:
    """Exit with status 1: the run itself failed (not the command line), with the message only."""
    parser.exit(common.EXIT_FAILURE, f"{parser.prog}: error: {message}\n")


if __name__ == "__main__":
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    main(sys.argv[1:])
