"""The attention layers of a model built on the meta device, grouped by the decisions their calls take: window,
chunk, soft-capping, scale, geometry and variant, read off the modules as transformers' attention classes name them."""

from dataclasses import dataclass

import torch

from optimum.habana.transformers.families.lookups import attention_modules_of, call_window
from optimum.habana.transformers.latent_attention import receives_compressed_latent


SINKS_VARIANT = "attention sinks: one more logit in each row's softmax"  # a layer group's variant


def softcap_fallback(softcap: float) -> str:
    """Why a soft-capped layer's calls take the default path with the flag (`attention.fused_path_refusal`)."""
    return f"soft-capped logits, softcap={softcap}: no fused kernel computes them"


@dataclass(frozen=True)
class LayerGroup:
    """Attention layers that take the same decisions: same window, soft-capping, scale and variant."""

    indices: tuple[int, ...]
    sliding_window: int | None
    softcap: float | None
    scaling: float
    variant: str = ""  # what the layer's attention does besides plain attention: sinks, latent heads, chunks, ...
    chunk: int | None = None  # a chunked layer's chunk size
    geometry: tuple[int, int, int, int, bool] = (1, 1, 1, 1, False)  # heads, kv heads, q/k and v head sizes, sinks
    latent: tuple[int, int] | None = None  # a compressed cache's latent and rotary key sizes (latent_attention.py)
    layer_indexed: bool = True  # `indices` are the decoder layers' (and the cache's) numbers, not the modules' order

    @property
    def label(self) -> str:
        noun = "layer" if len(self.indices) == 1 else "layers"
        return f"{noun} {format_indices(self.indices)}" + (f" ({self.variant})" if self.variant else "")


def attention_layer_groups(model: torch.nn.Module) -> list[LayerGroup]:
    """Each attention layer's window, soft-capping, scale and variant, read from the model built on the meta device
    (the modules of the family's attention classes, `FamilyReport.attention_classes`)."""
    modules = attention_modules_of(model)
    layer_indices = [getattr(module, "layer_idx", None) for module in modules]
    # The decoder layers' own numbers where every module has one of its own (Zamba's shared blocks have -1 or None)
    indexed = all(isinstance(index, int) and index >= 0 for index in layer_indices) and len(set(layer_indices)) == len(
        layer_indices
    )
    by_settings: dict[tuple, list[int]] = {}
    for ordinal, module in enumerate(modules):
        index = layer_indices[ordinal] if indexed else ordinal
        settings = (
            call_window(module, model.config),
            getattr(module, "attn_logit_softcapping", None),
            float(module.scaling),
            layer_variant(module, model.config),
            layer_chunk(module, model.config),
            layer_geometry(module, model.config),
            (module.kv_lora_rank, module.qk_rope_head_dim) if receives_compressed_latent(module) else None,
        )
        by_settings.setdefault(settings, []).append(index)
    return [LayerGroup(tuple(indices), *settings, layer_indexed=indexed) for settings, indices in by_settings.items()]


def layer_geometry(module: torch.nn.Module, config) -> tuple[int, int, int, int, bool]:
    """The shapes one layer hands the kernel: query heads, key/value heads, query/key and value head sizes, and
    whether it has sinks (read off the module as transformers' attention classes name them)."""
    layer_config = getattr(module, "config", None) or config
    heads = getattr(module, "num_heads", None) or layer_config.num_attention_heads
    groups = getattr(module, "num_key_value_groups", None)
    kv_heads = heads // groups if isinstance(groups, int) and groups else None
    kv_heads = kv_heads or getattr(layer_config, "num_key_value_heads", None) or heads  # GPT-2 names none: one a head
    head_dim = getattr(module, "qk_head_dim", None) or getattr(module, "head_dim", None)
    head_dim = head_dim or layer_config.hidden_size // layer_config.num_attention_heads
    value_dim = getattr(module, "v_head_dim", None) or head_dim
    return heads, kv_heads, head_dim, value_dim, isinstance(getattr(module, "sinks", None), torch.Tensor)


def layer_chunk(module: torch.nn.Module, config) -> int | None:
    layer_types = getattr(config, "layer_types", None) or ()
    layer_index = getattr(module, "layer_idx", None)
    chunked = (
        isinstance(layer_index, int)
        and layer_index < len(layer_types)
        and layer_types[layer_index] == "chunked_attention"
    )
    return config.attention_chunk_size if chunked else None


def layer_variant(module: torch.nn.Module, config) -> str:
    """What one attention layer does besides plain attention, in the words of the fused path's account."""
    parts = []
    layer_types = getattr(config, "layer_types", None) or ()
    layer_index = getattr(module, "layer_idx", None)
    kind = layer_types[layer_index] if isinstance(layer_index, int) and layer_index < len(layer_types) else None
    if kind == "chunked_attention":
        parts.append(f"chunked local attention, chunks of {config.attention_chunk_size} tokens")
    if isinstance(window := call_window(module, config), int):
        parts.append(f"sliding window of {window} tokens")
    if isinstance(getattr(module, "sinks", None), torch.Tensor):
        parts.append(SINKS_VARIANT)
    key_size, value_size = getattr(module, "qk_head_dim", None), getattr(module, "v_head_dim", None)
    if isinstance(key_size, int) and isinstance(value_size, int) and key_size != value_size:
        parts.append(f"latent attention: query/key heads of {key_size}, value heads of {value_size}")
    if getattr(module, "indexer", None) is not None:
        parts.append(f"sparse: the indexer's {getattr(config, 'index_topk', '?')} keys per query, as a mask")
    if isinstance(rate := getattr(getattr(module, "compressor", None), "compress_rate", None), int):  # DeepSeek V4
        parts.append(f"compressed blocks: one more key per {rate} tokens")
    if getattr(config, "is_heterogeneous", False):
        heads = getattr(module, "num_heads", None) or getattr(
            getattr(module, "config", None), "num_attention_heads", "?"
        )
        parts.append(f"this layer's geometry: {heads} heads of {getattr(module, 'head_dim', '?')}")
    return "; ".join(parts)


def other_layer_kinds(config) -> list[str]:
    """A hybrid's layers that are no softmax attention, counted by kind."""
    kinds = [
        kind for kind in getattr(config, "layer_types", None) or () if "attention" not in kind or "linear" in kind
    ]
    return [f"{kinds.count(kind)} {kind}" for kind in dict.fromkeys(kinds)]


def format_indices(indices: tuple[int, ...]) -> str:
    if list(indices) == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}-{indices[-1]}" if len(indices) > 1 else str(indices[0])
    return ",".join(str(index) for index in indices)


__all__ = [
    "SINKS_VARIANT",
    "LayerGroup",
    "attention_layer_groups",
    "format_indices",
    "other_layer_kinds",
    "softcap_fallback",
]
