"""Load a Gaudi causal LM and its tokenizer from anything `--model_name_or_path` accepts."""

import time
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..transformers.models import family_problem, gaudi_model_class
from .model_loading import ModelResolutionError, ResolvedModel, resolve_model


# Files from which AutoTokenizer builds a tokenizer; a checkpoint folder with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass
class LoadedModel:
    model: PreTrainedModel  # one of the Gaudi causal LMs
    tokenizer: PreTrainedTokenizerBase
    resolved: ResolvedModel
    load_seconds: float  # resolution (and GGUF conversion, if any) plus from_pretrained and the move to the device


def load_model_and_tokenizer(
    model_name_or_path: str | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    resolved: ResolvedModel | None = None,
    **from_pretrained_kwargs: Any,
) -> LoadedModel:
    """Resolve, load and move to `device`; a family without a Gaudi class is a ModelResolutionError saying why.

    `resolved`: the result of an earlier `resolve_model(model_name_or_path)`, not repeated. `from_pretrained_kwargs`
    go to `from_pretrained` (e.g. `distributed_config` for tensor parallelism).
    """
    start = time.perf_counter()
    if resolved is None:
        resolved = resolve_model(model_name_or_path)
    model_type = AutoConfig.from_pretrained(resolved.path).model_type
    problem = family_problem(model_type)
    if problem is not None:
        raise ModelResolutionError(
            f"{resolved.description} is a {model_type!r} model, which has no Gaudi class: {problem}."
        )
    model_class = gaudi_model_class(model_type)
    tokenizer = load_tokenizer(resolved)
    try:
        model = model_class.from_pretrained(resolved.path, dtype=dtype, **from_pretrained_kwargs)
    except SafetensorError as error:  # damage the header check cannot see (a corrupted header of the right size)
        raise ModelResolutionError(
            f"The weights in {str(resolved.path)!r} cannot be read ({error}): the checkpoint is damaged. Save or "
            "download it again."
        ) from None
    model = model.to(device).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model, tokenizer, resolved, time.perf_counter() - start)


def load_tokenizer(resolved: ResolvedModel) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer; a folder without one is a ModelResolutionError naming the folder.

    Without this check AutoTokenizer answers a folder that lacks tokenizer files with advice about sentencepiece
    or hub repo ids, which misleads.
    """
    if not any((resolved.path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelResolutionError(
            f"The checkpoint folder {str(resolved.path)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}). "
            "Save the tokenizer beside the model with tokenizer.save_pretrained(folder)."
        )
    try:
        return AutoTokenizer.from_pretrained(resolved.path)
    except (OSError, ValueError, TypeError) as error:
        detail = (str(error).strip().splitlines() or [""])[0]
        raise ModelResolutionError(
            f"The tokenizer files in {str(resolved.path)!r} cannot be loaded ({type(error).__name__}: {detail})."
        ) from error
