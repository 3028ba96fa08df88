"""run_generation.py's prompts: where they come from (`--prompt`, `--prompt_file`, `--book_source`, `--dataset_name`,
or built-in ones), how they fill the batch, and how they become left-padded token ids that fit the model.

`--dataset_name` / `--column_name` read prompts with the `datasets` library, as Optimum-Habana's run_generation.py
takes them, plus local data files (no hub needed).
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import (
    PreTrainedTokenizerBase,
)
from transformers.tokenization_utils_base import BatchEncoding

from optimum.habana.cli.common import LONG_PROMPT_PATH

from .arguments import WorkloadArguments


# Local files `datasets` reads with a packaged builder, by suffix.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def dataset_prompts(dataset_name: str, column_name: str | None) -> list[str]:
    """The non-empty texts of one column; a ValueError names the flag and what to pass instead."""
    import datasets

    path = Path(dataset_name).expanduser()
    if not path.exists() and looks_local(dataset_name):  # else `datasets` asks the hub, retries, then "cannot load"
        raise ValueError(
            f"--dataset_name {dataset_name!r}: no such file or folder. Pass your own data file "
            f"({', '.join(FILE_BUILDERS)}) or dataset folder, or a hub dataset id."
        )
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise ValueError(
                    f"--dataset_name {dataset_name!r}: a file must be one of {', '.join(FILE_BUILDERS)}; or pass a "
                    "dataset folder or hub id."
                )
            loaded = datasets.load_dataset(builder, data_files=str(path))
        else:
            loaded = datasets.load_dataset(dataset_name)
    except (FileNotFoundError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as error:
        detail = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"--dataset_name {dataset_name!r} cannot be loaded: {detail}") from None
    split = loaded["train"] if "train" in loaded else loaded[next(iter(loaded))]
    text_columns = [name for name, feature in split.features.items() if getattr(feature, "dtype", None) == "string"]
    column = column_name or (text_columns[0] if text_columns else None)
    if column is None or column not in text_columns:
        raise ValueError(
            f"--column_name {column!r} is not a text column of {dataset_name!r}; its text columns: "
            f"{', '.join(text_columns) or 'none'}."
        )
    prompts = [text for text in split[column] if isinstance(text, str) and text.strip()]
    if not prompts:
        raise ValueError(f"--dataset_name {dataset_name!r}: column {column!r} holds no text.")
    return prompts


def looks_local(name: str) -> bool:
    """A data file's suffix, or a path no hub id has (absolute, ./, ../, ~, more than one /)."""
    path = Path(name)
    return (
        path.suffix.lower() in FILE_BUILDERS
        or path.is_absolute()
        or name.startswith((".", "~"))
        or name.count("/") > 1
    )


# Prompts of different lengths, so that a batch of several is padded. The first one is Optimum-Habana's default.
DEFAULT_PROMPTS = (
    "DeepSpeed is a machine learning framework",
    "Here is a recipe for a simple tomato soup:",
    "The three largest planets of the solar system are",
    "Flash attention computes exact attention without ever building the full score matrix, which means that",
)


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
