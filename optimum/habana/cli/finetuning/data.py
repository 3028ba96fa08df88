"""run_lora_clm.py's data: files or hub datasets loaded and checked, instruction prompts, labels, packing, the collator,
and Optimum-Habana's data options (other column names, fewer examples).
"""

import logging
from itertools import chain
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict, load_dataset
from datasets.exceptions import DatasetGenerationError
from transformers import (
    AutoConfig,
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    PreTrainedConfig,
    PreTrainedTokenizerBase,
)

from optimum.habana.transformers.families.lookups import sequential_layers
from optimum.habana.utils.model_loading import ResolvedModel

from .errors import FineTuningError
from .prompts import DataFormat, as_text, build_styled_prompt, check_prompt_style


# The column each option renames, and the name the rest of the pipeline reads.
COLUMN_OPTIONS = {
    "instruction_column_name": "instruction",
    "input_column_name": "input",
    "output_column_name": "output",
}


def column_renames(arguments: object) -> dict[str, str]:
    """`{given name: our name}` for each column option given with another name than ours."""
    renames = {}
    for option, ours in COLUMN_OPTIONS.items():
        given = getattr(arguments, option)
        if given is not None and given != ours:
            renames[given] = ours
    return renames


def rename_columns(dataset: Dataset, renames: dict[str, str], source: str) -> Dataset:
    """The dataset with its columns renamed; a missing column, or one that would hide another, names the option."""
    options = {ours: option for option, ours in COLUMN_OPTIONS.items()}
    for given, ours in renames.items():
        if given not in dataset.column_names:
            raise FineTuningError(
                f"--{options[ours]} {given!r}: {source} has no such column (its columns: "
                f"{', '.join(dataset.column_names)})."
            )
        if ours in dataset.column_names:
            raise FineTuningError(
                f"--{options[ours]} {given!r}: {source} also has a column {ours!r}; rename or drop one of them."
            )
    return dataset.rename_columns(renames) if renames else dataset


def limit_examples(datasets: DatasetDict, max_train_samples: int | None, max_eval_samples: int | None) -> DatasetDict:
    """The first `max_train_samples` training and `max_eval_samples` validation examples (None: all)."""
    limits = {"train": max_train_samples, "validation": max_eval_samples}
    return DatasetDict(
        {
            split: dataset
            if limits.get(split) is None
            else dataset.select(range(min(limits[split], dataset.num_rows)))
            for split, dataset in datasets.items()
        }
    )


logger = logging.getLogger(__name__)


# `datasets` builder for each supported data file extension (".json" may hold JSON lines or one JSON array).
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}


INSTRUCTION_FIELDS = ("instruction", "input", "output")


REQUIRED_INSTRUCTION_FIELDS = ("instruction", "output")


TEXT_FIELD = "text"


# Label of the tokens that carry no loss (prompt and padding): the ignore_index of transformers' causal LM loss.
IGNORE_INDEX = -100


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
        datasets = DatasetDict(
            {
                split: drop_blank_rows(data, f"The dataset {dataset_name!r} ({split})", options["columns"])
                if set(REQUIRED_INSTRUCTION_FIELDS) <= set(data.column_names)
                else data
                for split, data in datasets.items()
            }
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
        dataset = drop_blank_rows(dataset, f"{argument} {path!r}", columns or {})
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


def drop_blank_rows(dataset: Dataset, source: str, renames: dict[str, str] | None = None) -> Dataset:
    """Instruction rows with every field blank, skipped and counted; none left is a FineTuningError. Such a row
    holds nothing of the data: its tokens are the prompt template's and the end token, which would train the
    adapter to answer nothing (and a run of nothing but such rows would train and exit 0). Then the responses:
    see `check_responses`. `renames` (`{their name: ours}`) names the columns as the data does."""
    fields = [name for name in INSTRUCTION_FIELDS if name in dataset.column_names]
    rows = dataset.num_rows
    dataset = dataset.filter(lambda example: any(str(example[name] or "").strip() for name in fields))
    if dataset.num_rows == 0:
        raise FineTuningError(f"{source} has no examples: the {', '.join(fields)} of every row are blank.")
    if dataset.num_rows < rows:
        logger.warning(
            "%s: skipped %d rows whose %s are all blank.", source, rows - dataset.num_rows, ", ".join(fields)
        )
    check_responses(dataset, source, renames or {})
    return dataset


def check_responses(dataset: Dataset, source: str, renames: dict[str, str]) -> None:
    """A blank response teaches the example's prompt to be answered by the end token alone (and, without
    --train_on_inputs, the prompt carries no loss): every response blank is a FineTuningError naming the column,
    some of them one warning that counts them."""
    theirs = {ours: given for given, ours in renames.items()}
    column = theirs.get("output", "output")
    blank = sum(not as_text(value).strip() for value in dataset["output"])
    if blank == dataset.num_rows:
        columns = ", ".join(theirs.get(name, name) for name in dataset.column_names)
        raise FineTuningError(
            f"{source}: the {column!r} column (the responses the adapter learns to write) is blank in every row: "
            "it would learn to answer nothing. Fill it in, or name the column that holds the responses with "
            f"--output_column_name (the columns: {columns})."
        )
    if blank:
        logger.warning(
            "%s: %d of %d rows have a blank %r: those examples learn only to end the response at once.",
            source,
            blank,
            dataset.num_rows,
            column,
        )


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


def check_padding_free_model(config: PreTrainedConfig) -> None:
    """--padding_free packs a batch's examples into one row, which the attention keeps apart by their position ids; a
    layer whose state runs along the sequence sees no such boundary and would carry it from one example into the
    next (stock transformers does the same, silently)."""
    if layers := sequential_layers(config):
        raise FineTuningError(
            f"--padding_free: the model type {config.model_type!r} has {', '.join(layers)} layers, whose state runs "
            "along the sequence: in a packed row it would carry from one example into the next. Drop --padding_free "
            "(each batch is then padded), or use --dataset_concatenation, whose blocks are trained as one text."
        )


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
