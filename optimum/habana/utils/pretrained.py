"""Load a Gaudi Llama and its tokenizer from anything `--model_name_or_path` accepts."""

import time
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from ..transformers.models.llama import GaudiLlamaForCausalLM
from .model_loading import ModelResolutionError, ResolvedModel, resolve_model


@dataclass
class LoadedModel:
    model: GaudiLlamaForCausalLM
    tokenizer: PreTrainedTokenizerBase
    resolved: ResolvedModel
    load_seconds: float  # resolution (and GGUF conversion, if any) plus from_pretrained and the move to the device


def load_model_and_tokenizer(
    model_name_or_path: str | None, *, dtype: torch.dtype, device: torch.device
) -> LoadedModel:
    """Resolve, load and move to `device`; a non-Llama checkpoint is a ModelResolutionError naming its type."""
    start = time.perf_counter()
    resolved = resolve_model(model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    model_type = _model_type(resolved)
    if model_type != "llama":
        raise ModelResolutionError(
            f"{model_name_or_path!r} is a {model_type!r} model; this library's models are Llama-architecture only."
        )
    model = GaudiLlamaForCausalLM.from_pretrained(resolved.path, dtype=dtype).to(device).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model, tokenizer, resolved, time.perf_counter() - start)


def _model_type(resolved: ResolvedModel) -> str:
    return AutoConfig.from_pretrained(resolved.path).model_type
