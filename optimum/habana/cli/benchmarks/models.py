"""The models the flash-attention benchmark runs: checkpoints, synthetic presets, stock transformers, and the floor.

A synthetic preset has the attention geometry of a real model (hidden size, heads, key/value heads, head size,
RoPE base, and the family's variant: windows, sinks, latent attention) with random weights, a configurable number of layers and a reduced MLP, so that long sequences fit a
small machine while every attention call has the real shape. Its label says so in every table.

The floor is the same model with each attention call replaced by a pass-through of V and no mask at all: what
the rest of the forward costs, which no attention implementation can go below.
"""

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import CONFIG_MAPPING, AttentionInterface, AutoConfig, AutoModelForCausalLM, PreTrainedConfig
from transformers.masking_utils import AttentionMaskInterface

from optimum.habana.transformers.families.reports import family_report
from optimum.habana.transformers.models import gaudi_model_class
from optimum.habana.utils.model_loading import DEFAULT_MODEL_NAME, ModelResolutionError, resolve_model


FLOOR_ATTENTION = "benchmark_floor"


# Every path a benchmark row can run; "default" and "flash" are this library's, "eager"/"sdpa" stock transformers'.
PATHS = ("default", "flash", "eager", "sdpa", "floor")


@dataclass(frozen=True)
class Preset:
    """Attention geometry of a real model; `source` names it in the label. Families other than Llama name their
    model type and the config values that make their variant (windows, sinks, latent attention)."""

    source: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float
    model_type: str = "llama"
    head_dim: int | None = None
    variant: dict = field(default_factory=dict)


# A window every second layer, sinks in every layer; four small experts, two a token.
GPT_OSS_20B = {"sliding_window": 128, "num_local_experts": 4, "num_experts_per_tok": 2}
# Five windowed layers of 1024 tokens for each full one; its query scaling.
GEMMA3_4B = {"sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256}
# Latent attention: keys and values from a 512-wide latent, query/key heads of 128 + 64, value heads of 128.
DEEPSEEK_V2_LITE = {
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
}

# DeepSeek-V3's latent attention: 128 heads, queries from a 1536-wide latent, the same head sizes as V2-Lite.
DEEPSEEK_V3 = {**DEEPSEEK_V2_LITE, "q_lora_rank": 1536, "n_group": 1, "topk_group": 1}

PRESETS = {
    "llama2-7b-attn": Preset("Llama-2-7B", 4096, 32, 32, 10000.0),
    "llama3-8b-attn": Preset("Llama-3-8B", 4096, 32, 8, 500000.0),
    "smollm2-attn": Preset("SmolLM2-135M", 576, 9, 3, 100000.0),
    "gpt-oss-20b-attn": Preset("gpt-oss-20b", 2880, 64, 8, 150000.0, "gpt_oss", 64, GPT_OSS_20B),
    "gemma-2b-attn": Preset("Gemma-2B", 2048, 8, 1, 10000.0, "gemma", 256),
    "gemma3-4b-attn": Preset("Gemma-3-4B", 2560, 8, 4, 1000000.0, "gemma3_text", 256, GEMMA3_4B),
    "deepseek-v2-lite-attn": Preset("DeepSeek-V2-Lite", 2048, 16, 16, 10000.0, "deepseek_v2", 64, DEEPSEEK_V2_LITE),
    "deepseek-v3-attn": Preset("DeepSeek-V3", 7168, 128, 128, 10000.0, "deepseek_v3", 64, DEEPSEEK_V3),
}


PRESET_VOCAB_SIZE = 32000  # Llama-2's; generate() computes the logits of the last position only


PRESET_MAX_POSITIONS = 131072


@dataclass(frozen=True)
class ModelSpec:
    """What a benchmark row names in its Model column, and how a worker builds it."""

    name: str  # a preset name, DEFAULT_MODEL_NAME or anything --model_name_or_path accepts
    preset_layers: int = 1
    preset_intermediate_size: int = 2048

    @property
    def is_preset(self) -> bool:
        return self.name in PRESETS

    @property
    def label(self) -> str:
        if not self.is_preset:
            return self.name
        preset = PRESETS[self.name]
        return (
            f"{self.name} (synthetic: {preset.source} attention, {self.preset_layers} layer"
            f"{'s' if self.preset_layers > 1 else ''}, MLP {self.preset_intermediate_size}, random weights)"
        )


def preset_config(spec: ModelSpec) -> PreTrainedConfig:
    preset = PRESETS[spec.name]
    mlp = spec.preset_intermediate_size
    experts = {"moe_intermediate_size": mlp} if "n_routed_experts" in preset.variant else {}
    return CONFIG_MAPPING[preset.model_type](
        vocab_size=PRESET_VOCAB_SIZE,
        hidden_size=preset.hidden_size,
        intermediate_size=mlp,
        num_hidden_layers=spec.preset_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.head_dim or preset.hidden_size // preset.num_attention_heads,
        max_position_embeddings=PRESET_MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta},
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **experts,
        **preset.variant,
    )


def checkpoint_path(name: str) -> Any:
    """The loadable folder for a non-preset model name; DEFAULT_MODEL_NAME is the embedded SmolLM2."""
    return resolve_model(None if name == DEFAULT_MODEL_NAME else name).path


def resolve_checkpoint(name: str) -> Path:
    """The model's folder; a name that is no model but close to a preset (a typo) is told the presets first."""
    try:
        return checkpoint_path(name)
    except ModelResolutionError as error:
        close = difflib.get_close_matches(name, PRESETS, n=1, cutoff=0.75)
        if not close and not name.endswith("-attn"):
            raise
        guess = f"did you mean {close[0]!r}? " if close else ""
        raise ModelResolutionError(
            f"--model_name_or_path {name!r} is not a preset: {guess}The presets are {', '.join(PRESETS)}. "
            f"(As a model it could not be found: {error})"
        ) from None


def build_model(spec: ModelSpec, path: str, dtype: torch.dtype, seed: int) -> nn.Module:
    """The model a path runs: the Gaudi class ("default"/"flash"), stock transformers ("eager"/"sdpa"), the floor.

    Presets are initialised from `seed`, so every path of a row runs the same weights.
    """
    stock_attention = {"eager": "eager", "sdpa": "sdpa", "floor": FLOOR_ATTENTION}.get(path)
    if spec.is_preset:
        config = preset_config(spec)
        model_type = PRESETS[spec.name].model_type
        torch.manual_seed(seed)
        if stock_attention is None:
            model = gaudi_model_class(model_type)(config)
        else:
            config._attn_implementation = stock_attention
            model = getattr(transformers, family_report(model_type).class_name)(config)
        return model.to(dtype)
    folder = checkpoint_path(spec.name)
    if stock_attention is None:
        model_type = AutoConfig.from_pretrained(folder).model_type
        return gaudi_model_class(model_type).from_pretrained(folder, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=stock_attention)


def floor_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """No attention at all: each query position gets the V row of its own position (heads repeated for GQA).

    One copy, the `[B, q, H, D]` output every attention function returns; nothing else is allocated.
    """
    batch, heads, q_len = query.shape[:3]
    value_dim = value.shape[-1]  # latent attention's value head differs from the query's
    own = value[:, :, -q_len:].transpose(1, 2).unsqueeze(3)  # [B, q, Hkv, 1, Dv], a view
    groups = heads // value.shape[1]
    return own.expand(batch, q_len, value.shape[1], groups, value_dim).reshape(batch, q_len, heads, value_dim), None


def no_mask(*args: Any, **kwargs: Any) -> None:
    """The floor builds no mask: any mask is attention work."""
    return None


AttentionInterface.register(FLOOR_ATTENTION, floor_attention)


AttentionMaskInterface.register(FLOOR_ATTENTION, no_mask)
