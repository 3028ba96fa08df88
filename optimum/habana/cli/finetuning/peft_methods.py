"""`--peft_type` for run_lora_clm.py: Optimum-Habana's adapter methods (LoRA, IA3, AdaLoRA, llama-adapter, VeRA,
LayerNorm tuning) through PEFT, on every supported family.

PEFT knows default target modules for some model types only (none for Phi3, StarCoder2, Granite, OLMo2 or the
MoE families), so the defaults here are read from the model itself: the attention projections for LoRA, AdaLoRA
and VeRA (the usual names, and the linear layers inside the family's attention modules: latent attention's), the key/value projections and the dense MLP's down projection for IA3, every normalization layer for
LayerNorm tuning. PEFT's adaption prompt (llama-adapter) rewrites Llama- and Mistral-style attention only; for any
other family the run stops before the model loads, naming the families that work.

An option of another method than the chosen one would do nothing, so it is refused.
"""

from dataclasses import dataclass, field, fields
from typing import Any

import torch
from peft import (
    AdaLoraConfig,
    AdaLoraModel,
    AdaptionPromptConfig,
    IA3Config,
    LNTuningConfig,
    LoraConfig,
    PeftConfig,
    PeftModel,
    TaskType,
    VeraConfig,
    get_peft_model,
)
from transformers import PreTrainedConfig, PreTrainedModel, TrainerCallback
from transformers.pytorch_utils import Conv1D

from optimum.habana.transformers.attention_flags import attention_flags_of
from optimum.habana.transformers.families.lookups import attention_modules_of

from .errors import FineTuningError


PEFT_TYPES = ("lora", "ia3", "adalora", "llama-adapter", "vera", "ln_tuning")


# PEFT's adaption prompt computes the adapter's attention with Llama's projections and rotary embedding.
ADAPTION_PROMPT_MODEL_TYPES = ("llama", "mistral")


# Default targets, whichever of these the family has (Phi3 fuses q, k and v; StarCoder2's MLP ends in c_proj).
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")


IA3_ATTENTION_TARGETS = ("k_proj", "v_proj", "qkv_proj")


MLP_OUTPUT_PROJECTIONS = ("down_proj", "c_proj")


# Layer types PEFT's LoRA-like methods can adapt, listed when a target name matches nothing.
ADAPTABLE_LAYERS = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, Conv1D)


@dataclass
class PeftArguments:
    """Optimum-Habana's `--peft_type` and each method's own options (LoRA's are LoraArguments)."""

    peft_type: str = field(
        default="lora",
        metadata={
            "choices": list(PEFT_TYPES),
            "help": "The adapter method (PEFT). lora and adalora use --lora_alpha, --lora_dropout and "
            "--lora_target_modules; llama-adapter works on Llama and Mistral models.",
        },
    )
    adalora_init_r: int = field(default=12, metadata={"help": "AdaLoRA: initial rank of every adapted layer."})
    adalora_target_r: int = field(default=4, metadata={"help": "AdaLoRA: average rank after pruning."})
    adalora_tinit: int = field(default=50, metadata={"help": "AdaLoRA: steps before the ranks are pruned."})
    adalora_tfinal: int = field(default=100, metadata={"help": "AdaLoRA: last steps, with the final ranks."})
    adalora_delta_t: int = field(default=10, metadata={"help": "AdaLoRA: steps between two rank updates."})
    adalora_orth_reg_weight: float = field(
        default=0.5, metadata={"help": "AdaLoRA: weight of the orthogonality loss added to the training loss."}
    )
    ia3_target_modules: list[str] | None = field(
        default=None, metadata={"help": "IA3: layers to scale (default: key, value and MLP down projections)."}
    )
    feedforward_modules: list[str] | None = field(
        default=None,
        metadata={"help": "IA3: which of its targets are MLP layers, scaled on their input (default: down_proj)."},
    )
    adapter_layers: int = field(default=30, metadata={"help": "llama-adapter: top decoder layers that get one."})
    adapter_len: int = field(default=10, metadata={"help": "llama-adapter: learned prompt tokens per layer."})
    vera_target_modules: list[str] | None = field(
        default=None, metadata={"help": "VeRA: layers to adapt (default: the attention projections)."}
    )
    ln_target_modules: list[str] | None = field(
        default=None, metadata={"help": "LayerNorm tuning: norms to train (default: every normalization layer)."}
    )


# Which method each option belongs to; giving one to another method is an error.
OPTION_METHODS = {
    "lora_rank": ("lora",),
    "lora_alpha": ("lora", "adalora"),
    "lora_dropout": ("lora", "adalora"),
    "lora_target_modules": ("lora", "adalora"),
    **{f.name: ("adalora",) for f in fields(PeftArguments) if f.name.startswith("adalora_")},
    "ia3_target_modules": ("ia3",),
    "feedforward_modules": ("ia3",),
    "adapter_layers": ("llama-adapter",),
    "adapter_len": ("llama-adapter",),
    "vera_target_modules": ("vera",),
    "ln_target_modules": ("ln_tuning",),
}


def check_peft_arguments(peft_args: PeftArguments, lora_args: Any) -> None:
    """Options of another method than --peft_type, and values PEFT would refuse deep inside."""
    misplaced = []
    for group in (lora_args, peft_args):
        for option in fields(group):
            methods = OPTION_METHODS.get(option.name)
            if methods is None or peft_args.peft_type in methods:
                continue
            default = option.default_factory() if callable(option.default_factory) else option.default
            if getattr(group, option.name) != default:
                misplaced.append(f"--{option.name} ({' or '.join(methods)})")
    if misplaced:
        raise FineTuningError(
            f"--peft_type {peft_args.peft_type} does not use {', '.join(misplaced)}: remove them or choose that "
            "--peft_type."
        )
    if peft_args.peft_type in ("lora", "adalora"):
        check_lora_values(
            lora_args.lora_rank, lora_args.lora_dropout, lora_args.lora_target_modules, lora_args.lora_alpha
        )
    if peft_args.peft_type == "adalora":
        for name in ("adalora_init_r", "adalora_target_r", "adalora_delta_t"):
            if getattr(peft_args, name) < 1:
                raise FineTuningError(f"--{name} must be at least 1, got {getattr(peft_args, name)}.")
        for name in ("adalora_tinit", "adalora_tfinal"):
            if getattr(peft_args, name) < 0:
                raise FineTuningError(f"--{name} must be 0 or more, got {getattr(peft_args, name)}.")
        if peft_args.adalora_orth_reg_weight <= 0:
            raise FineTuningError(
                f"--adalora_orth_reg_weight must be above 0 (PEFT's AdaLoRA requires it), got "
                f"{peft_args.adalora_orth_reg_weight}."
            )
    if peft_args.peft_type == "llama-adapter":
        for name in ("adapter_layers", "adapter_len"):
            if getattr(peft_args, name) < 1:
                raise FineTuningError(f"--{name} must be at least 1, got {getattr(peft_args, name)}.")


def check_lora_values(rank: int, dropout: float, target_modules: Any, alpha: float) -> None:
    """LoRA's numbers and targets, named after their command-line flags."""
    if rank < 1:
        raise FineTuningError(f"--lora_rank must be at least 1, got {rank}.")
    if alpha == 0:
        raise FineTuningError(
            "--lora_alpha 0 scales the adapter's update by 0 (alpha / rank): it would never train. Pass a nonzero "
            "--lora_alpha."
        )
    if not 0.0 <= dropout < 1.0:
        raise FineTuningError(f"--lora_dropout must be in [0, 1), got {dropout}.")
    if target_modules is not None and not target_modules:
        raise FineTuningError("--lora_target_modules is empty; name at least one module, e.g. q_proj v_proj.")


def check_model_supports(peft_args: PeftArguments, config: PreTrainedConfig) -> None:
    """What can be told from the model's config, before its weights load."""
    if peft_args.peft_type != "llama-adapter":
        return
    if config.model_type not in ADAPTION_PROMPT_MODEL_TYPES:
        raise FineTuningError(
            f"--peft_type llama-adapter: PEFT's adaption prompt supports {' and '.join(ADAPTION_PROMPT_MODEL_TYPES)} "
            f"models only, and this model is a {config.model_type}. Choose another --peft_type: "
            f"{', '.join(peft_type for peft_type in PEFT_TYPES if peft_type != 'llama-adapter')}."
        )
    layers = config.num_hidden_layers
    if peft_args.adapter_layers > layers:
        raise FineTuningError(
            f"--adapter_layers {peft_args.adapter_layers}: the model has {layers} decoder layers; pass {layers} "
            "or less."
        )


def module_names(model: PreTrainedModel) -> set[str]:
    """The last component of every module name: what PEFT's target_modules match."""
    return {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}


def default_targets(peft_type: str, model: PreTrainedModel) -> tuple[list[str], list[str]]:
    """(target modules, IA3 feed-forward modules) read from the model, for a method given no targets."""
    names = module_names(model)
    if peft_type == "ln_tuning":
        norms = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if "Norm" in type(module).__name__}
        return sorted(norms), []
    if peft_type == "ia3":
        mlp_outputs = {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if name.rsplit(".", 1)[-1] in MLP_OUTPUT_PROJECTIONS
            and ".mlp." in f".{name}"
            and hasattr(module, "weight")
        }
        attention = [name for name in IA3_ATTENTION_TARGETS if name in names]
        return attention + sorted(mlp_outputs), sorted(mlp_outputs)
    known = [name for name in ATTENTION_PROJECTIONS if name in names]
    return known + sorted(attention_linears(model) - set(known)), []


def attention_linears(model: PreTrainedModel) -> set[str]:
    """The linear layers inside the family's attention modules (latent attention's q_a_proj, kv_b_proj, ...): the
    attention projections of a family whose names the list above does not know."""
    return {
        name
        for module in attention_modules_of(model)
        for name, child in module.named_children()
        if isinstance(child, torch.nn.Linear | Conv1D)
    }


def peft_config(peft_args: PeftArguments, lora_args: Any, model: PreTrainedModel) -> PeftConfig:
    """The PEFT config of --peft_type with its options; targets left unset are the model's defaults.

    AdaLoRA's `total_step` is a placeholder here: `AdaLoraSchedule` sets the Trainer's step count when training
    begins, since only the Trainer knows it.
    """
    peft_type = peft_args.peft_type
    task = TaskType.CAUSAL_LM
    if peft_type == "lora":
        return LoraConfig(
            task_type=task,
            r=lora_args.lora_rank,
            lora_alpha=lora_args.lora_alpha,
            lora_dropout=lora_args.lora_dropout,
            target_modules=lora_args.lora_target_modules or default_targets(peft_type, model)[0],
        )
    if peft_type == "adalora":
        return AdaLoraConfig(
            task_type=task,
            init_r=peft_args.adalora_init_r,
            target_r=peft_args.adalora_target_r,
            tinit=peft_args.adalora_tinit,
            tfinal=peft_args.adalora_tfinal,
            deltaT=peft_args.adalora_delta_t,
            orth_reg_weight=peft_args.adalora_orth_reg_weight,
            total_step=peft_args.adalora_tinit + peft_args.adalora_tfinal + 1,
            lora_alpha=lora_args.lora_alpha,
            lora_dropout=lora_args.lora_dropout,
            target_modules=lora_args.lora_target_modules or default_targets(peft_type, model)[0],
        )
    if peft_type == "ia3":
        targets, feedforward = default_targets(peft_type, model)
        targets = peft_args.ia3_target_modules or targets
        feedforward = [name for name in feedforward if name in targets]
        feedforward = peft_args.feedforward_modules if peft_args.feedforward_modules is not None else feedforward
        unknown = sorted(set(feedforward) - set(targets))
        if unknown:
            raise FineTuningError(
                f"--feedforward_modules {' '.join(unknown)}: every feed-forward module must also be one of the IA3 "
                f"targets ({' '.join(targets)}); add it to --ia3_target_modules."
            )
        return IA3Config(task_type=task, target_modules=targets, feedforward_modules=feedforward)
    if peft_type == "llama-adapter":
        return AdaptionPromptConfig(
            task_type=task, adapter_layers=peft_args.adapter_layers, adapter_len=peft_args.adapter_len
        )
    if peft_type == "vera":
        return VeraConfig(
            task_type=task, target_modules=peft_args.vera_target_modules or default_targets(peft_type, model)[0]
        )
    return LNTuningConfig(
        task_type=task, target_modules=peft_args.ln_target_modules or default_targets(peft_type, model)[0]
    )


def target_flag(peft_type: str) -> str:
    """The option that names the targets of `peft_type`, for error messages."""
    return {
        "lora": "--lora_target_modules",
        "adalora": "--lora_target_modules",
        "ia3": "--ia3_target_modules",
        "vera": "--vera_target_modules",
        "ln_tuning": "--ln_target_modules",
    }.get(peft_type, "--peft_type")


def check_target_modules(model: PreTrainedModel, targets: Any, peft_type: str) -> None:
    """Every target name must match a module: PEFT refuses only when none does, and silently leaves out the
    others (a misspelt `v_prj` next to `q_proj` trains without its adapter)."""
    if targets is None or isinstance(targets, str):  # a regular expression, matched by PEFT on full names
        return
    modules = dict(model.named_modules())
    unknown = [
        target for target in targets if not any(name == target or name.endswith(f".{target}") for name in modules)
    ]
    if unknown:
        if peft_type == "ln_tuning":
            available = default_targets(peft_type, model)[0]
        else:
            available = sorted(
                {name.rsplit(".", 1)[-1] for name, module in modules.items() if isinstance(module, ADAPTABLE_LAYERS)}
            )
        raise FineTuningError(
            f"{target_flag(peft_type)}: {type(model).__name__} has no module named {', '.join(map(repr, unknown))}. "
            f"Its layers that --peft_type {peft_type} can adapt: {' '.join(available)}."
        )


def add_adapter(model: PreTrainedModel, config: PeftConfig, peft_type: str) -> PeftModel:
    """Wrap `model` with the trainable adapter of `config`, checking that the attention flags survive the wrapping.

    The base model keeps its own generation config, which its forward reads the flags from; a wrapper that
    replaced it would silently turn flash attention off.
    """
    if peft_type in ("lora", "adalora") and config.target_modules is None:
        config.target_modules = default_targets(peft_type, model)[0]
    check_target_modules(model, getattr(config, "target_modules", None), peft_type)
    generation_config = model.generation_config
    flags = attention_flags_of(generation_config)
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as error:  # e.g. "Target modules {...} not found in the base model"
        raise FineTuningError(f"{target_flag(peft_type)}: {error}") from None
    base_config = peft_model.get_base_model().generation_config
    if base_config is not generation_config or attention_flags_of(base_config) != flags:
        raise RuntimeError("PEFT replaced the base model's generation config: the attention flags would be lost.")
    return peft_model


class AdaLoraSchedule(TrainerCallback):
    """AdaLoRA's rank budget, which transformers' Trainer does not drive.

    PEFT's AdaLoRA prunes ranks only when `update_and_allocate` runs after each optimizer step, with the gradients
    still there; without this callback its ranks would silently stay at --adalora_init_r.
    """

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        adalora = adalora_model(model)
        config = adalora.peft_config[adalora.trainable_adapter_name]
        if config.tinit >= state.max_steps - config.tfinal:
            raise FineTuningError(
                f"--adalora_tinit {config.tinit} and --adalora_tfinal {config.tfinal} leave no step to prune the "
                f"ranks in this run's {state.max_steps} steps: their sum must be below the step count. Lower them "
                "or train longer."
            )
        config.total_step = state.max_steps  # the rank allocator reads it from this config at every update

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        adalora_model(model).update_and_allocate(state.global_step)


def adalora_model(model: Any) -> AdaLoraModel:
    """The AdaLoraModel inside the PeftModel the Trainer holds (possibly wrapped for distributed training)."""
    model = getattr(model, "module", model)
    adalora = model.base_model
    if not isinstance(adalora, AdaLoraModel):
        raise TypeError(f"AdaLoraSchedule needs an AdaLoRA model, got {type(adalora).__name__}.")
    return adalora
