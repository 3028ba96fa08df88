"""`run_generation.py --explain`, its key lengths: how many keys each attention layer reads in each phase.

They depend on the cache a run builds and on each layer's kind in it (a sliding-window layer keeps its window, a
bucketed layer reads its filled buckets, a static one its whole length, Gaudi's hold every window at the whole
length), so they are read off that cache itself: the one `KVCacheSupply` hands generate(), or else the one generate()
builds (`generation_cache`), updated on the meta device as the run's prompt and decode steps update it (no memory,
nothing computed).
"""

import torch
from transformers import DynamicCache, PreTrainedConfig, StaticCache
from transformers.cache_utils import Cache, DummyLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HCACache

from optimum.habana.transformers.cache import BucketedStaticCache, static_cache_problem
from optimum.habana.transformers.generation.utils import generation_cache
from optimum.habana.transformers.growing_cache import GrowingCache

from ..generation_config import CacheLayout, KVCacheSupply
from .layers import LayerGroup


def run_cache(
    layout: CacheLayout, config: PreTrainedConfig, max_cache_len: int, device: torch.device, compiled: bool
) -> tuple[Cache | None, str]:
    """The cache a run's generate() fills (None without one, `--use_kv_cache False`), and what it is in words."""
    if layout.kind == "none":
        return None, layout.describe(max_cache_len)
    text_config = config.get_text_config(decoder=True)
    supplied = KVCacheSupply(layout, text_config, max_cache_len)()
    if supplied is not None:
        return supplied, layout.describe(max_cache_len)
    stock = DynamicCache if layout.kind == "dynamic" else StaticCache
    static_shapes = device.type == "hpu"  # `needs_static_shapes` of the model's weights
    length = generated_cache_length(max_cache_len)
    cache = generation_cache(text_config, stock, length, length, static_shapes=static_shapes, compiled=compiled)
    if cache is None:
        return DynamicCache(config=text_config), (
            f"dynamic: grows by one token per step; on Gaudi too, as {static_cache_problem(text_config)} (one graph "
            "per decode step's shape; one warning)"
        )
    if isinstance(cache, GrowingCache):
        return cache, "dynamic: grows by one token per step (GrowingCache: a DynamicCache appended in place)"
    buckets = (
        f"in buckets of {cache.bucket_size} (one graph per bucket)"
        if cache.bucket_size > 1
        else "over its filled slots"
    )
    asked = "dynamic asked, static on Gaudi" if layout.kind == "dynamic" else "static"
    windows = ", every window at the whole length" if static_shapes else ""
    return cache, (
        f"{asked}: {length} slots (prompt + --max_new_tokens - 1, as generate() sizes it), attended {buckets}"
        f"{windows} (generate()'s BucketedStaticCache); allocated by every run"
    )


def generated_cache_length(max_cache_len: int) -> int:
    """The slots of a cache generate() builds: its `max_length - 1`, since no key of the last token is read."""
    return max_cache_len - 1


def group_lengths(
    cache: Cache | None, groups: list[LayerGroup], rows: int, input_length: int, max_new_tokens: int
) -> list[dict[str, tuple[int, int]]]:
    """Per layer group, its fewest and most keys in the prompt's forward ("prefill") and over the decode steps
    ("decode"); an empty dict without a cache (every call reads the whole sequence). The layers of a group share
    their window and chunk, so one layer per kind of cache layer among them stands for the group."""
    if cache is None:
        return [{} for _ in groups]
    layers = [
        {type(cache.layers[index]): index for index in group.indices if holds_keys(cache, index)}.values()
        if group.layer_indexed
        else ()
        for group in groups
    ]
    seen = {index: [] for indices in layers for index in indices}
    past = 0
    for new_tokens in [input_length] + [1] * (max_new_tokens - 1):
        if isinstance(cache, BucketedStaticCache):
            cache.prepare_for_new_tokens(new_tokens)  # as `prepare_inputs_for_generation` does before each forward
        states = torch.empty(rows, 1, new_tokens, 1, device="meta")
        positions = torch.arange(past, past + new_tokens, device="meta")
        for index in seen:
            keys, _ = cache.update(states, states, index, {"cache_position": positions})
            seen[index].append(keys.shape[2] + compressed_entries(cache.layers[index], past + new_tokens))
        past += new_tokens
    result = []
    for indices in layers:
        # A layer whose keys no cache layer of its own holds (shared blocks): a static cache's are its whole length.
        whole = (cache.max_cache_len, cache.max_cache_len) if isinstance(cache, StaticCache) else None
        lengths = {"prefill": whole, "decode": whole} if whole and not indices else {}
        if indices:
            prompt = [seen[index][0] for index in indices]
            lengths["prefill"] = (min(prompt), max(prompt))
        if indices and max_new_tokens > 1:
            steps = [length for index in indices for length in seen[index][1:]]
            lengths["decode"] = (min(steps), max(steps))
        result.append(lengths)
    return result


def compressed_entries(layer: object, tokens: int) -> int:
    """The keys a layer's attention reads beyond its cache's own after `tokens` tokens: DeepSeek V4's compressed
    blocks, one per `compress_rate` tokens, every one of them on the key axis after the window's keys (its sparse
    layers' indexer masks the ones it does not pick; it does not drop them)."""
    return tokens // layer.compress_rate if isinstance(layer, DeepseekV4HCACache) else 0


def holds_keys(cache: Cache, index: int) -> bool:
    """Whether layer `index` of `cache` keeps keys of its own: not a layer that reads another's (Gemma 3n's shared
    ones, `DummyLayer`), nor a linear-attention layer (Zamba's attention reads its own cache); those groups keep the
    whole sequence's key lengths."""
    layer = cache.layers[index] if 0 <= index < len(cache.layers) else None
    return layer is not None and not isinstance(layer, DummyLayer) and hasattr(layer, "update")


__all__ = ["generated_cache_length", "group_lengths", "run_cache"]
