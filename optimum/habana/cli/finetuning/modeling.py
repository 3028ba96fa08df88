"""run_lora_clm.py's model side: the attention flags, LoRA, and the prompts completed after training.

The attention flags travel on `model.generation_config`, never as Trainer keyword arguments:
The Gaudi models' `forward` falls back to that config for every flag a call leaves unset, so training,
evaluation, generation, PEFT wrappers and activation checkpointing all see the same flags without the Trainer
knowing about them (a trainer that injected the flag into forward calls broke models that do not take it).
"""

import math
from collections.abc import Sequence

import torch
from peft import LoraConfig, PeftModel, TaskType
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from optimum.habana.cli.common import AttentionArguments
from optimum.habana.transformers.attention_flags import AttentionFlags
from optimum.habana.transformers.generation import GaudiGenerationConfig

from .errors import FineTuningError
from .peft_methods import add_adapter, check_lora_values, default_targets


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
    check_lora_values(rank, dropout, target_modules, alpha)
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
