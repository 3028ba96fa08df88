"""A tiny random config of any causal-LM family, built the way transformers' model testers build theirs: the same
small sizes everywhere, and just enough layers that every kind of layer the family mixes appears once.

One rule for every family (`SIZES`, only for the fields a config class has); the few families that need values of
their own (a size another one must divide, a field set after the config is built) get them in `OVERRIDES`.
"""

import dataclasses
import inspect
import warnings

import torch
from transformers import CONFIG_MAPPING, PreTrainedConfig

from optimum.habana.transformers.families.qualification import default_config


SIZES = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # mixtures of experts: four small experts, two per token
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "intermediate_size_mlp": 128,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    # latent attention: the value head (16) narrower than the query/key head (16 + 8)
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    # linear-attention and state-space layers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "mamba_d_state": 16,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_d_ssm": 128,
    "mamba_chunk_size": 16,
    "ssm_state_size": 16,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "n_groups": 1,
    # sparse-attention indexers: fewer keys than a 12-token prompt, so the selection matters
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 6,
    # Qwen4-Exp's QSA indexer: a budget of 6 keys, selected in blocks of 2
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 6,
    "indexer_compress_ratio": 2,
    # per-layer inputs (Gemma 3n/4)
    "hidden_size_per_layer_input": 16,
}
# Windows and chunks shorter than the tests' 12-token prompts, where the family has them.
WINDOWS = {"sliding_window": 8, "attention_chunk_size": 8}
# Families whose configs need a value of their own; each entry says why.
ROPE_PER_LAYER_TYPE = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in ("full", "sliding")}
OVERRIDES: dict[str, dict] = {
    # rotary parameters per layer type, which its default leaves empty
    "cohere_compass_text": {
        "rope_parameters": {f"{kind}_attention": value for kind, value in ROPE_PER_LAYER_TYPE.items()}
    },
    # the last layers reuse earlier layers' keys and values: two of four, each kind produced before
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
    },
    # its default has no attention layer at all
    "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "attention"]},
    # its layer types have no default: a convolution layer, then an attention layer
    "lfm2_moe": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # sizes under other names, and the attention's own sub-config
    "dbrx": {
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 2,
        "max_seq_len": 2048,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
    # one expert per token only
    "zaya": {"num_experts_per_tok": 1},
    # its MLP width under its own name
    "ctrl": {"dff": 128},
    # its sliding-window layers' own geometry (per-layer heads and sizes), small too
    "dots3_note_text": {
        "swa_num_attention_heads": 2,
        "swa_num_key_value_heads": 2,
        "swa_q_lora_rank": 16,
        "swa_kv_lora_rank": 16,
        "swa_head_dim": 24,
        "swa_qk_nope_head_dim": 16,
        "swa_v_head_dim": 8,
    },
    # its pattern of global and local layers, for its two layers
    "gpt_neo": {"num_layers": 2, "attention_types": [[["global", "local"], 1]]},
    # its full-attention layers' own head size (512 by default): per-layer geometry, small
    "gemma4_text": {"global_head_dim": 32},
    "gemma4_unified_text": {"global_head_dim": 32},
    # its layer count and zero-compute experts under their own names
    "longcat_flash": {"num_layers": 2, "zero_expert_num": 2},
    # its shared transformer block is tied across its attention layers: two of them
    "zamba": {"num_hidden_layers": 5},
    # its layer pattern under its own name (54 layers by default), two hybrid layers sharing two blocks
    "zamba2": {
        "num_hidden_layers": 4,
        "num_mem_blocks": 2,
        "use_mem_rope": True,
        "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"],
    },
}
# Llama 4 as its checkpoints are: chunked layers with rotary embeddings, then a full-attention layer without (NoPE),
# here every third, whose queries are scaled by their position (temperature tuning), from the second token on, not
# the 8192nd.
OVERRIDES["llama4"] = OVERRIDES["llama4_text"] = {"no_rope_layer_interval": 3, "floor_scale": 2}
MAX_LAYERS = 8


# Attention parameters a family's init leaves at a value that makes every score equal (uniform attention, which no
# error of scale or of the scores' kernel can change): set as a trained checkpoint's would be, so that the family tests
# can see the attention. ZAYA multiplies its keys by a per-head temperature that starts at 0.
ATTENTION_THAT_MATTERS = {"zaya": {"qk_norm.temp": 1.0}}


def with_attention_that_matters(model: torch.nn.Module, model_type: str) -> torch.nn.Module:
    """The model with the parameters of `ATTENTION_THAT_MATTERS` set (in place)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            for suffix, value in ATTENTION_THAT_MATTERS.get(model_type, {}).items():
                if name.endswith(suffix):
                    parameter.fill_(value)
    return model


def without_dropout(config_class: type) -> dict[str, float]:
    """Every dropout (and router noise) of a config class at 0: training steps then compare exactly."""
    return {
        name: 0.0
        for name in _settable_fields(config_class)
        if any(part in name for part in ("dropout", "pdrop", "jitter"))
        if not isinstance(getattr(default_config(config_class), name, None), bool)
    }


def tiny_family_config(model_type: str, config_class: type | None = None, **overrides) -> PreTrainedConfig:
    """A tiny config of `model_type`, of `config_class` where the causal LM takes another than the model type's own
    (a multimodal model type whose causal LM is the text model). Random weights come from the model's own init."""
    config_class = config_class or CONFIG_MAPPING[model_type]
    fields = _settable_fields(config_class)
    aliases = getattr(config_class, "attribute_map", {})  # a config's own names: n_embd for hidden_size, ...
    values = {}
    for name, value in SIZES.items():
        field_name = name if name in fields else aliases.get(name)
        if field_name in fields:
            values[field_name] = value
    default = default_config(config_class)
    for name, value in WINDOWS.items():
        if name in fields and getattr(default, name, None) is not None:
            values[name] = value
    if getattr(default, "q_lora_rank", None) is not None and "q_lora_rank" in fields:
        values["q_lora_rank"] = 32
    if "kv_lora_rank" in fields:  # latent attention expands its compressed keys and values to every head
        values["num_key_value_heads"] = SIZES["num_attention_heads"]
        if "head_dim" in fields:
            values["head_dim"] = SIZES["qk_rope_head_dim"]  # the rotary part of a head
    if "attn_layer_indices" in fields:  # hybrids that name their attention layers: the second one
        values["attn_layer_indices"] = [1]
    for name in ("attn_layer", "expert_layer"):  # hybrids that place them by period: every second layer
        if f"{name}_period" in fields:
            values[f"{name}_period"], values[f"{name}_offset"] = 2, 1
    if getattr(default, "first_k_dense_replace", None) and "first_k_dense_replace" in fields:
        values["first_k_dense_replace"] = 1
    values.update(OVERRIDES.get(model_type, {}))
    values.update(overrides)
    if "vocab_size_per_layer_input" in fields and "vocab_size" in values:  # Gemma 3n/4: one vocabulary for both
        values["vocab_size_per_layer_input"] = values["vocab_size"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**values)
        layers_field = "num_hidden_layers" if "num_hidden_layers" in fields else aliases.get("num_hidden_layers")
        if layers_field in values.keys() & (overrides.keys() | OVERRIDES.get(model_type, {}).keys()):
            return config
        if layers_field not in fields:
            return config
        layers = _one_layer_of_each_kind(config)
        values[layers_field] = len(layers)
        for name in ("layer_types", "mlp_layer_types"):
            kinds = getattr(config, name, None)
            if name in fields and isinstance(kinds, list) and kinds:
                values[name] = [kinds[index] for index in layers]
        return config_class(**values)


def _settable_fields(config_class: type) -> set[str]:
    names = set()
    for klass in config_class.__mro__:
        if dataclasses.is_dataclass(klass):
            names |= {field.name for field in dataclasses.fields(klass)}
        if "__init__" in vars(klass):
            names |= set(inspect.signature(klass.__init__).parameters)
    properties = {name for name in dir(config_class) if isinstance(getattr(config_class, name, None), property)}
    return names - properties - {"self", "kwargs", "args"}


def _one_layer_of_each_kind(config: PreTrainedConfig) -> list[int]:
    """The indices of the layers to keep: the first layer of each kind (of layer and of MLP) the config mixes, in
    order, and at least two."""
    patterns = []
    for name in ("layer_types", "mlp_layer_types", "layers_block_type"):
        try:
            kinds = getattr(config, name, None)
        except Exception:
            kinds = None
        if isinstance(kinds, list | tuple) and kinds:
            patterns.append(list(kinds))
    first = {kinds.index(kind) for kinds in patterns for kind in set(kinds)}
    keep = sorted(first | {0, 1})
    return keep[:MAX_LAYERS]
