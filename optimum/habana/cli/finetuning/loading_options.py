"""Optimum-Habana's model and data loading options of run_lora_clm.py: what each does here.

Acting: `--config_name` and `--tokenizer_name` (load those instead of the model folder's), `--token`, `--cache_dir`
and `--model_revision` (for a hub repo: the model download and hub datasets), `--overwrite_cache` (tokenize again),
`--keep_in_memory` (data loaded into memory), `--dataset_seed` (the validation split's seed), `--sql_prompt`
(question/context/answer data in a SQL prompt). The others name something transformers 5 or this device decides:
each prints one line.
"""

from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer, PreTrainedConfig, PreTrainedTokenizerBase

from optimum.habana.utils.model_loading import ResolvedModel

from .errors import FineTuningError


PROMPT_STYLES = ("instruction", "chat", "sql")


# --sql_prompt's columns, read as instruction/input/output unless a column option names others.
SQL_COLUMNS = {"instruction_column_name": "question", "input_column_name": "context", "output_column_name": "answer"}


def prompt_style(data_args: Any) -> str:
    """Which prompt the instruction examples get; --chat_prompt and --sql_prompt together are a usage error."""
    if data_args.chat_prompt and data_args.sql_prompt:
        raise FineTuningError("--chat_prompt and --sql_prompt choose two prompts: pass one.")
    return "chat" if data_args.chat_prompt else "sql" if data_args.sql_prompt else "instruction"


def apply_sql_columns(data_args: Any) -> None:
    """With --sql_prompt, the column options not given read upstream's SQL columns."""
    if data_args.sql_prompt:
        for option, column in SQL_COLUMNS.items():
            if getattr(data_args, option) is None:
                setattr(data_args, option, column)


def hub_options(model_args: Any) -> dict[str, Any]:
    """`resolve_model`'s hub options from the command line (they change nothing for local models)."""
    return {
        "revision": None if model_args.model_revision == "main" else model_args.model_revision,
        "cache_dir": model_args.cache_dir,
        "token": model_args.token,
    }


def loading_notes(model_args: Any, data_args: Any, resolved: ResolvedModel) -> list[str]:
    """One line for each given option that this run does not act on, and why."""
    notes = []
    if model_args.model_revision != "main" and resolved.source != "hub":
        notes.append(
            f"--model_revision {model_args.model_revision}: {resolved.description} is not a hub repo, so it has no "
            "revisions; it is loaded as it is."
        )
    if model_args.use_auth_token:
        notes.append("--use_auth_token: deprecated upstream; the hub login, HF_TOKEN or --token is used as it is.")
    if not model_args.use_fast_tokenizer:
        notes.append("--use_fast_tokenizer False: transformers 5 has one tokenizer class per model; it is used.")
    if model_args.trust_remote_code:
        notes.append(
            "--trust_remote_code: the supported families are transformers' own classes; no code from the model "
            "repo runs."
        )
    if model_args.load_meta_device:
        notes.append(
            "--load_meta_device: transformers 5 always builds the model on the meta device and loads into it."
        )
    if model_args.flash_attention_fp8:
        notes.append(
            "--flash_attention_fp8: fp8 attention is not supported by this library; the fused kernel runs in the "
            "model's dtype."
        )
    if data_args.dataset_cache_directory:
        notes.append(
            f"--dataset_cache_directory {data_args.dataset_cache_directory}: datasets caches the processed data in "
            "its own cache (HF_DATASETS_CACHE); --overwrite_cache rebuilds it."
        )
    return notes


def load_config_override(config_name: str | None, token: str | None) -> PreTrainedConfig | None:
    """--config_name's config, checked before the weights load; None without it."""
    if config_name is None:
        return None
    try:
        return AutoConfig.from_pretrained(config_name, token=token)
    except (OSError, ValueError) as error:
        detail = (str(error).strip().splitlines() or [""])[0]
        raise FineTuningError(f"--config_name {config_name!r} holds no usable model config ({detail}).") from None


def load_tokenizer_override(tokenizer_name: str | None, token: str | None) -> PreTrainedTokenizerBase | None:
    """--tokenizer_name's tokenizer; None without it."""
    if tokenizer_name is None:
        return None
    try:
        return AutoTokenizer.from_pretrained(tokenizer_name, token=token)
    except (OSError, ValueError) as error:
        detail = (str(error).strip().splitlines() or [""])[0]
        raise FineTuningError(f"--tokenizer_name {tokenizer_name!r} holds no usable tokenizer ({detail}).") from None


def check_config_fits(config: PreTrainedConfig | None, model_config_path: Path) -> None:
    """--config_name must describe the same family as the checkpoint, or the weights would not load into it."""
    if config is None:
        return
    model_type = AutoConfig.from_pretrained(model_config_path).model_type
    if config.model_type != model_type:
        raise FineTuningError(
            f"--config_name is a {config.model_type} config but the model is a {model_type}; pass a config of the "
            "same family."
        )
