#!/usr/bin/env python
"""LoRA fine-tuning of a causal LM (any supported family) with the Gaudi attention, on transformers' Trainer and PEFT.

    python examples/language-modeling/run_lora_clm.py --output_dir outputs/lora --do_train --do_eval \
        --use_flash_attention --max_steps 40 --learning_rate 1e-3 --per_device_train_batch_size 8

With no --model_name_or_path it fine-tunes the embedded SmolLM2-135M-Instruct; with no --train_file, on the
shipped examples/language-modeling/data/instructions.jsonl. The adapter is saved to --output_dir, where
`examples/text-generation/run_generation.py --peft_model DIR` picks it up. See docs/fine_tuning.md.

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
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from optimum.habana.example_support import finetuning
from optimum.habana.example_support.arguments import AttentionArguments
from optimum.habana.utils import devices
from optimum.habana.utils.model_loading import ModelResolutionError
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


ARGUMENT_CLASSES = (ModelArguments, DataArguments, LoraArguments, AttentionArguments, GenerationArguments)


def main(argv: Sequence[str] | None = None, callbacks: list[TrainerCallback] | None = None) -> dict[str, Any]:
    """Fine-tune, evaluate, save the adapter; returns the metrics (also in OUTPUT_DIR/all_results.json).

    A usage problem (bad argument, unusable data file or model) exits with status 2 and a one-line message.
    """
    parser = HfArgumentParser((*ARGUMENT_CLASSES, TrainingArguments), prog=Path(__file__).name)
    try:
        model_args, data_args, lora_args, attention_args, generation_args, training_args = (
            parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
        )
    except ValueError as error:  # unknown arguments, and TrainingArguments' own checks
        usage_error(parser, str(error))
    try:
        flags = finetuning.attention_flags_from(attention_args)
        check_arguments(data_args, generation_args, training_args)
        train_file = data_args.train_file
        if train_file is None and data_args.dataset_name is None:
            train_file = str(DEFAULT_TRAIN_FILE)
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
        loaded = load_model_and_tokenizer(model_args.model_name_or_path, dtype=dtype, device=training_args.device)
        model, tokenizer = loaded.model, loaded.tokenizer
        # Before PEFT wraps the model: its forward reads the flags from here on every call.
        finetuning.set_attention_flags(model, flags)
        model = finetuning.add_lora(model, lora_config)
    except (finetuning.FineTuningError, ModelResolutionError) as error:
        usage_error(parser, str(error))

    logger.info("Model: %s, %s, attention flags %s", loaded.resolved.description, dtype, flags)
    if training_args.local_process_index == 0:
        model.print_trainable_parameters()

    tokenizer.padding_side = "right"  # training batches: real tokens first, so positions start at 0
    datasets = {}
    for split, dataset in raw_datasets.items():
        with training_args.main_process_first(desc=f"tokenizing {split}"):
            tokenized = finetuning.tokenize_dataset(
                dataset, tokenizer, data_format, None if data_args.dataset_concatenation else data_args.max_seq_length
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

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=datasets["train"] if training_args.do_train else None,
        eval_dataset=datasets.get("validation") if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=finetuning.IGNORE_INDEX),
        callbacks=callbacks,
    )
    device = training_args.device
    metrics: dict[str, Any] = {}

    if training_args.do_train:
        devices.reset_peak_memory(device)
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        devices.synchronize(device)
        train_metrics = {**train_result.metrics, "train_peak_memory_gb": peak_memory_gb(device)}
        train_metrics["train_samples"] = datasets["train"].num_rows
        trainer.save_model()  # the LoRA adapter and the tokenizer, loadable by run_generation.py --peft_model
        trainer.save_state()
        trainer.log_metrics("train", train_metrics)
        trainer.save_metrics("train", train_metrics)
        metrics.update(train_metrics)

    if training_args.do_eval:
        devices.reset_peak_memory(device)
        eval_metrics = trainer.evaluate()
        eval_metrics["perplexity"] = finetuning.perplexity(eval_metrics["eval_loss"])
        eval_metrics["eval_peak_memory_gb"] = peak_memory_gb(device)
        eval_metrics["eval_samples"] = datasets["validation"].num_rows
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)

    if generation_args.generation_samples > 0:
        generations = generate_samples(model, tokenizer, raw_datasets, data_format, generation_args)
        if trainer.is_world_process_zero():
            path = Path(training_args.output_dir) / "generations.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(generations, indent=2) + "\n")
        metrics["generations"] = generations

    if trainer.is_world_process_zero():
        print(summary(metrics, flags.use_flash_attention, training_args))
    return metrics


def check_arguments(
    data_args: DataArguments, generation_args: GenerationArguments, training_args: TrainingArguments
) -> None:
    """Values the parser accepts but that cannot work; each is a FineTuningError naming the flag."""
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


if __name__ == "__main__":
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    main(sys.argv[1:])
