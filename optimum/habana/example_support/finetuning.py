"""LoRA fine-tuning of a Gaudi causal LM: data, prompt template, labels, packing, LoRA and the attention flags.

The logic behind `examples/language-modeling/run_lora_clm.py`, kept here so that it is tested and reusable.

The attention flags travel on `model.generation_config`, never as Trainer keyword arguments:
The Gaudi models' `forward` falls back to that config for every flag a call leaves unset, so training,
evaluation, generation, PEFT wrappers and activation checkpointing all see the same flags without the Trainer
knowing about them (a trainer that injected the flag into forward calls broke models that do not take it).
"""

import logging
import math
from collections.abc import Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, DatasetDict, load_dataset
from datasets.exceptions import DatasetGenerationError
from peft import LoraConfig, PeftModel, TaskType
from transformers import (
    AutoConfig,
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..transformers.attention_flags import AttentionFlags
from ..transformers.generation import GaudiGenerationConfig
from ..utils.model_loading import ResolvedModel
from .arguments import AttentionArguments
from .data_options import rename_columns
from .errors import FineTuningError
from .peft_methods import add_adapter, check_lora_values, default_targets
from .prompts import DataFormat, as_text, build_styled_prompt, check_prompt_style


logger = logging.getLogger(__name__)

# `datasets` builder for each supported data file extension (".json" may hold JSON lines or one JSON array).
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}
INSTRUCTION_FIELDS = ("instruction", "input", "output")
REQUIRED_INSTRUCTION_FIELDS = ("instruction", "output")
TEXT_FIELD = "text"

# Label of the tokens that carry no loss (prompt and padding): the ignore_index of transformers' causal LM loss.
IGNORE_INDEX = -100


# --- data -------------------------------------------------------------------------------------------------------


def load_raw_datasets(
    *,
    train_file: str | None,
    validation_file: str | None,
    dataset_name: str | None,
    dataset_config_name: str | None = None,
    validation_split_percentage: int = 10,
    seed: int = 42,
    columns: dict[str, str] | None = None,
    keep_linebreaks: bool = False,
    load_options: dict[str, Any] | None = None,
) -> tuple[DatasetDict, DataFormat]:
    """The "train" (and, when there is one, "validation") split, and whether it is instruction data or plain text.

    Without a validation file or split, `validation_split_percentage` percent of the training data is held out.
    `columns` renames columns first (`{their name: ours}`); `keep_linebreaks` keeps each .txt line's newline;
    `load_options` go to `datasets.load_dataset` (keep_in_memory, and cache_dir and token for the hub).
    Every problem with the data is a FineTuningError that names the file and the problem.
    """
    if not 0 <= validation_split_percentage < 100:
        raise FineTuningError(f"--validation_split_percentage must be in [0, 100), got {validation_split_percentage}.")
    if dataset_name is not None and train_file is not None:
        raise FineTuningError("Pass either --dataset_name or --train_file, not both.")
    load_options = load_options or {}
    options = {"columns": columns or {}, "keep_linebreaks": keep_linebreaks, "load_options": load_options}
    if dataset_name is not None:
        datasets = load_hub_dataset(dataset_name, dataset_config_name, **load_options)
        datasets = DatasetDict(
            {split: rename_columns(data, options["columns"], dataset_name) for split, data in datasets.items()}
        )
    else:
        if train_file is None:
            raise FineTuningError("No training data: pass --train_file or --dataset_name.")
        datasets = DatasetDict({"train": load_data_file(train_file, "--train_file", **options)})
    if validation_file is not None:
        datasets["validation"] = load_data_file(validation_file, "--validation_file", **options)

    train_source = f"--train_file {train_file!r}" if dataset_name is None else f"The dataset {dataset_name!r}"
    data_format = data_format_of(datasets["train"], train_source)
    if "validation" in datasets:
        validation_source = (
            f"--validation_file {validation_file!r}" if validation_file else f"{train_source}'s validation split"
        )
        validation_format = data_format_of(datasets["validation"], validation_source)
        if validation_format != data_format:
            raise FineTuningError(
                f"The training data is {data_format} data but the validation data is {validation_format} data; "
                "use one format for both."
            )
    elif validation_split_percentage > 0:
        if datasets["train"].num_rows < 2:
            raise FineTuningError(
                "The training data has a single example: too few to hold out a validation split. "
                "Pass --validation_file, or --validation_split_percentage 0 without --do_eval."
            )
        split = datasets["train"].train_test_split(test_size=validation_split_percentage / 100, seed=seed)
        datasets = DatasetDict({"train": split["train"], "validation": split["test"]})
    return datasets, data_format


def check_max_seq_length(max_seq_length: int, resolved: ResolvedModel) -> None:
    """Longer examples than the model has positions would train on positions it never learned, or run out of memory."""
    positions = getattr(AutoConfig.from_pretrained(resolved.path), "max_position_embeddings", None)
    if positions is not None and max_seq_length > positions:
        raise FineTuningError(
            f"--max_seq_length {max_seq_length} is beyond the model's {positions} positions (its "
            f"max_position_embeddings): pass --max_seq_length {positions} or less. Model: {resolved.description}."
        )


def load_data_file(
    path: str,
    argument: str,
    columns: dict[str, str] | None = None,
    keep_linebreaks: bool = False,
    load_options: dict[str, Any] | None = None,
) -> Dataset:
    """One json, jsonl, csv or txt file (one example per line for txt), through the `datasets` builders."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FineTuningError(f"{argument} {path!r} does not exist.")
    builder = DATA_FILE_BUILDERS.get(file.suffix.lower())
    if builder is None:
        raise FineTuningError(
            f"{argument} {path!r}: unsupported file type {file.suffix!r}; use one of {', '.join(DATA_FILE_BUILDERS)}."
        )
    if file.stat().st_size == 0:
        raise FineTuningError(f"{argument} {path!r} is empty.")
    check_utf8(file, argument)
    try:
        options = {"keep_linebreaks": True} if builder == "text" and keep_linebreaks else {}
        options.update(keep_in_memory=bool((load_options or {}).get("keep_in_memory")))
        dataset = load_dataset(builder, data_files=str(file), split="train", **options)
    except DatasetGenerationError as error:
        cause = error.__cause__ or error
        raise FineTuningError(f"{argument} {path!r} could not be read as {builder}: {cause}") from None
    except ValueError as error:
        # datasets says 'Instruction "train" corresponds to no data!' for a file without rows (blank lines only,
        # a CSV header only).
        if "corresponds to no data" in str(error):
            raise FineTuningError(f"{argument} {path!r} has no examples.") from None
        raise FineTuningError(f"{argument} {path!r} could not be read as {builder}: {error}") from None
    dataset = rename_columns(dataset, columns or {}, f"{argument} {path!r}")
    if set(REQUIRED_INSTRUCTION_FIELDS) <= set(dataset.column_names):
        for name in REQUIRED_INSTRUCTION_FIELDS:
            check_no_missing_values(dataset, name, file, argument)
    elif TEXT_FIELD in dataset.column_names:
        if builder != "text":
            check_no_missing_values(dataset, TEXT_FIELD, file, argument)
        rows = dataset.num_rows
        dataset = dataset.filter(lambda example: bool((example[TEXT_FIELD] or "").strip()))
        # Blank lines separate paragraphs in .txt files: not examples, and not worth a word. Elsewhere they are rows.
        if builder != "text" and dataset.num_rows < rows:
            logger.warning("%s %r: skipped %d rows with a blank text.", argument, path, rows - dataset.num_rows)
    if dataset.num_rows == 0:
        raise FineTuningError(f"{argument} {path!r} has no examples.")
    return dataset


def check_utf8(file: Path, argument: str) -> None:
    """Refuse a file that is not UTF-8 text, naming the line: the builders fail on it with a deep traceback.

    NUL bytes are valid UTF-8 but mark binary data, which would otherwise train as text without a word.
    """
    with open(file, "rb") as stream:
        for number, line in enumerate(stream, start=1):
            if b"\x00" in line:
                raise FineTuningError(
                    f"{argument} {str(file)!r} is not text: line {number} holds a NUL byte at column "
                    f"{line.index(0) + 1}. Pass a text file."
                )
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise FineTuningError(
                    f"{argument} {str(file)!r} is not UTF-8 text: line {number} has the byte "
                    f"{line[error.start : error.start + 1]!r} at column {error.start + 1}. Save the file as UTF-8."
                ) from None


def check_no_missing_values(dataset: Dataset, name: str, file: Path, argument: str) -> None:
    """Refuse rows whose `name` field is missing or null, naming the first one: an example without its answer
    would otherwise train on an empty response."""
    missing = [index for index, value in enumerate(dataset[name]) if value is None]
    if missing:
        more = f" (and {len(missing) - 1} more rows)" if len(missing) > 1 else ""
        raise FineTuningError(
            f"{argument} {str(file)!r}: {row_location(file, missing[0], dataset.num_rows)} has no {name!r} value "
            f"(missing or null){more}. Fill it in or remove the row."
        )


def row_location(file: Path, index: int, rows: int) -> str:
    """Where row `index` is in the file: its line for JSON lines and simple CSV files, else its row number."""
    with open(file, encoding="utf-8") as stream:
        lines = [number for number, line in enumerate(stream, start=1) if line.strip()]
    if file.suffix.lower() == ".csv" and len(lines) == rows + 1:  # a header, and no cell spans lines
        return f"line {lines[index + 1]}"
    if file.suffix.lower() in (".json", ".jsonl") and len(lines) == rows:  # one JSON object per line
        return f"line {lines[index]}"
    return f"row {index + 1}"


def load_hub_dataset(name: str, config_name: str | None, **load_options: Any) -> DatasetDict:
    """A dataset from the Hugging Face Hub; an unreachable hub or an unknown name is a FineTuningError."""
    try:
        datasets = load_dataset(name, config_name, **load_options)
    except (OSError, ValueError) as error:  # ConnectionError and DatasetNotFoundError are OSErrors
        detail = (str(error).strip().splitlines() or [""])[0]
        raise FineTuningError(
            f"Could not load the dataset {name!r} from the Hugging Face Hub ({type(error).__name__}: {detail}). "
            "The hub may be unreachable from this machine (HF_HUB_OFFLINE=1 makes that fail at once); "
            "pass --train_file with a local json, jsonl, csv or txt file instead."
        ) from None
    if "train" not in datasets:
        raise FineTuningError(f"The dataset {name!r} has no 'train' split (it has {', '.join(datasets)}).")
    splits = {"train": datasets["train"]}
    if "validation" in datasets:
        splits["validation"] = datasets["validation"]
    return DatasetDict(splits)


def data_format_of(dataset: Dataset, source: str) -> DataFormat:
    """Instruction data has `instruction` and `output` (and optionally `input`) fields; plain text has `text`."""
    columns = set(dataset.column_names)
    if set(REQUIRED_INSTRUCTION_FIELDS) <= columns:
        return "instruction"
    if TEXT_FIELD in columns:
        return "text"
    raise FineTuningError(
        f"{source} has the fields {sorted(columns)}, none of the expected ones: instruction data needs "
        "`instruction` and `output` (and optionally `input`), plain text needs `text`."
    )


# --- prompts, labels, packing -----------------------------------------------------------------------------------


def tokenize_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    data_format: DataFormat,
    max_seq_length: int | None,
    train_on_inputs: bool = False,
    prompt_style: str = "instruction",
    load_from_cache_file: bool | None = None,
) -> Dataset:
    """`input_ids`, `attention_mask` and `labels` for each example, truncated to `max_seq_length` (None: not).

    Instruction data: the loss is on the response tokens and the end-of-sequence token, and on the prompt only
    with `train_on_inputs` (Optimum-Habana's default); `prompt_style` "chat" puts the instruction in the model's
    chat template, "sql" in the SQL prompt, instead of the '### Instruction:' prompt. `load_from_cache_file` False
    tokenizes again instead of reusing datasets' cache.
    Plain text: the loss is on every token. Examples left with nothing to learn after truncation are dropped.
    """
    check_prompt_style(prompt_style, tokenizer, data_format)
    if tokenizer.eos_token_id is None:
        raise FineTuningError("The tokenizer has no end-of-sequence token; fine-tuning needs one to end examples.")
    if max_seq_length is not None and max_seq_length < 1:
        raise FineTuningError(f"--max_seq_length must be at least 1, got {max_seq_length}.")

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        if data_format == "instruction":
            inputs = batch.get("input") or [""] * len(batch["instruction"])
            prompts = [
                build_styled_prompt(prompt_style, tokenizer, instruction, input)
                for instruction, input in zip(batch["instruction"], inputs, strict=True)
            ]
            responses = [as_text(output) for output in batch["output"]]
        else:
            prompts = [""] * len(batch[TEXT_FIELD])
            responses = [as_text(text) for text in batch[TEXT_FIELD]]
        # Prompt and response are tokenized apart, so the label boundary falls exactly between their tokens.
        prompt_ids = tokenizer(prompts, add_special_tokens=prompt_style != "chat")["input_ids"]
        response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
        features = {"input_ids": [], "attention_mask": [], "labels": []}
        for prompt, response in zip(prompt_ids, response_ids, strict=True):
            response = [*response, tokenizer.eos_token_id]
            input_ids = [*prompt, *response][:max_seq_length]
            masked = data_format == "instruction" and not train_on_inputs
            labels = [IGNORE_INDEX] * len(prompt) if masked else list(prompt)
            labels = [*labels, *response][:max_seq_length]
            features["input_ids"].append(input_ids)
            features["attention_mask"].append([1] * len(input_ids))
            features["labels"].append(labels)
        return features

    tokenized = dataset.map(
        tokenize,
        batched=True,
        remove_columns=dataset.column_names,
        desc="Tokenizing",
        load_from_cache_file=load_from_cache_file,
    )
    kept = tokenized.filter(has_loss_tokens, desc="Dropping examples with nothing to learn")
    if kept.num_rows < tokenized.num_rows:
        logger.warning(
            "Skipped %d of %d examples that keep no token to learn within --max_seq_length %s (the prompt fills it).",
            tokenized.num_rows - kept.num_rows,
            tokenized.num_rows,
            max_seq_length,
        )
    return kept


def has_loss_tokens(example: dict[str, list[int]]) -> bool:
    """Whether any token after the first carries a label (the model predicts token i+1 from token i)."""
    return any(label != IGNORE_INDEX for label in example["labels"][1:])


def pack_sequences(dataset: Dataset, max_seq_length: int) -> Dataset:
    """Concatenate the tokenized examples and cut them into blocks of `max_seq_length` tokens.

    No padding, so no mask: every block is a plain causal sequence, the cheapest case for the fused kernel.
    Labels are packed alongside, so instruction prompts stay out of the loss. The last block may be shorter.
    """
    if max_seq_length < 1:
        raise FineTuningError(f"--max_seq_length must be at least 1, got {max_seq_length}.")

    def pack(batch: dict[str, list]) -> dict[str, list]:
        packed = {}
        for name in ("input_ids", "attention_mask", "labels"):
            tokens = list(chain.from_iterable(batch[name]))
            packed[name] = [tokens[start : start + max_seq_length] for start in range(0, len(tokens), max_seq_length)]
        return packed

    packed = dataset.map(pack, batched=True, remove_columns=dataset.column_names, desc="Packing")
    return packed.filter(has_loss_tokens, desc="Dropping blocks with nothing to learn")


# --- attention flags and LoRA -----------------------------------------------------------------------------------


def attention_flags_from(arguments: AttentionArguments) -> AttentionFlags:
    """The validated flags; a companion flag without `--use_flash_attention` is a FineTuningError."""
    try:
        return arguments.attention_flags()
    except ValueError as error:
        raise FineTuningError(f"Attention flags: {error}") from None


def set_attention_flags(model: PreTrainedModel, flags: AttentionFlags) -> None:
    """Make `flags` the model's own, for every forward and generate call that does not pass them explicitly.

    Call it before wrapping the model with PEFT. The command line's values replace whatever the checkpoint's
    generation config said, so the flags in effect are exactly the ones the user passed.
    """
    config = model.generation_config
    if not isinstance(config, GaudiGenerationConfig):
        raise TypeError(
            f"{type(model).__name__}.generation_config is a {type(config).__name__}, not a GaudiGenerationConfig: "
            "the attention flags would not reach the attention. Load the model with its Gaudi class."
        )
    for name, value in flags.as_dict().items():
        setattr(config, name, value)


def lora_config(*, rank: int, alpha: float, dropout: float, target_modules: Sequence[str] | None = None) -> LoraConfig:
    """A causal-LM LoRA config; bad values are FineTuningErrors named after their command-line flag.

    `target_modules=None` means the model's attention projections, filled in by `add_lora`.
    """
    check_lora_values(rank, dropout, target_modules)
    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=None if target_modules is None else list(target_modules),
    )


def attention_projections(model: PreTrainedModel) -> list[str]:
    """The attention projection names this model has: LoRA's default targets."""
    return default_targets("lora", model)[0]


def add_lora(model: PreTrainedModel, config: LoraConfig) -> PeftModel:
    """Wrap `model` with trainable LoRA adapters (its attention projections unless `config` names targets)."""
    return add_adapter(model, config, "lora")


# --- training ---------------------------------------------------------------------------------------------------


# --- results ----------------------------------------------------------------------------------------------------


def data_collator(tokenizer: PreTrainedTokenizerBase, *, padding_free: bool, pad_to: int | None = None) -> Any:
    """Padded batches (right padding, no loss on it; to `pad_to` tokens when given), or one padding-free row per
    batch.

    A padding-free row restarts its position ids at every example; the Gaudi models isolate the examples from
    those (`optimum.habana.transformers.packing`), and its first label of each example is ignored, as the shift of
    a padded batch ignores it.
    """
    if padding_free:
        return DataCollatorWithFlattening(separator_id=IGNORE_INDEX)
    if pad_to is not None:
        return DataCollatorForSeq2Seq(
            tokenizer, label_pad_token_id=IGNORE_INDEX, padding="max_length", max_length=pad_to
        )
    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX)


def perplexity(loss: float) -> float:
    """exp(mean token cross-entropy); inf when that overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@torch.no_grad()
def complete_prompts(
    model: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_new_tokens: int,
) -> list[str]:
    """Greedy completions of `prompts` in one left-padded batch; the flags come from the model's generation config."""
    inputs = tokenizer(list(prompts), return_tensors="pt", padding=True, padding_side="left").to(model.device)
    was_training = model.training
    model.eval()
    try:
        outputs = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    finally:
        model.train(was_training)
    return tokenizer.batch_decode(outputs[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
