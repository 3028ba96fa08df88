"""The bridge that carries the attention flags from generate() to the model's forward, on every step, the KV cache
generate() builds when the caller gives none, and its stop strings matched without a vocabulary-wide precompute."""

import copy
from typing import Any

from transformers import DynamicCache, GenerationConfig, StaticCache, StoppingCriteriaList, StopStringCriteria

from ...kernels.dispatch import needs_static_shapes, warn_once
from ..attention_flags import ATTENTION_FLAG_NAMES, attention_flags_of, resolve_attention_flags
from ..cache import BucketedStaticCache, static_cache_problem
from ..families.source_facts import drops_generation_kwargs
from ..growing_cache import GrowingCache
from .stop_strings import TailStopStringCriteria


# Tokens per bucket of a static cache whose shapes must stay static (compiled decode steps, Gaudi): one graph each.
STATIC_SHAPES_BUCKET = 256


def generation_cache(
    config,
    stock: type[DynamicCache] | type[StaticCache],
    max_cache_length: int,
    max_cache_len: int,
    *,
    static_shapes: bool,
    compiled: bool,
) -> GrowingCache | BucketedStaticCache | None:
    """The cache generate() builds in place of transformers' `stock` one (`_prepare_cache_for_generation`): growing to
    the `max_cache_length` tokens the call needs, or static over `max_cache_len` slots; None where stock's stays (a
    family transformers builds no static cache for, on Gaudi). `run_generation.py --explain` asks it too, to say how
    many keys each layer's attention reads."""
    if stock is DynamicCache and not static_shapes:
        return GrowingCache(config, max_cache_length)
    if stock is DynamicCache and static_cache_problem(config):
        return None
    bucket_size = STATIC_SHAPES_BUCKET if static_shapes or compiled else 1
    return BucketedStaticCache(config, max_cache_len, bucket_size, preallocate=True, full_length_windows=static_shapes)


def _check_flags_reach_forward(
    model_class: type, flags: dict[str, bool], model_defaults: dict[str, bool | None]
) -> None:
    """The flags reach each step's forward in its keyword arguments, through the model's
    `prepare_inputs_for_generation`. One that hands on only the inputs it names (a subclass's own, say) drops them,
    and forward then runs on `model.generation_config`'s flags: where those differ from the call's, the call's
    would silently do nothing, so it is an error before anything is generated. Defaults that are no valid setting
    alone (a companion without the flag, which the call turns on) would fail forward: they differ too."""
    try:
        forward_flags = resolve_attention_flags(model_defaults).as_dict()
    except ValueError:
        forward_flags = None
    if flags == forward_flags:
        return
    dropped = drops_generation_kwargs(model_class)
    if dropped is None:
        return
    asked = ", ".join(f"{name}={value}" for name, value in flags.items() if value)
    raise ValueError(
        f"{dropped}, so the attention flags given to generate() ({asked or 'all off'}) would not reach the model's "
        "forward, which would run on model.generation_config's instead. Return its **kwargs with the inputs (or call "
        "super()), or set the flags on model.generation_config."
    )


class GaudiGenerationMixin:
    """Mix into a `GenerationMixin` model whose forward names the attention flags.

    Stock generate() either rejects the flags as unused model kwargs or, once the generation config has them as
    attributes, absorbs them into the config and never passes them on. Here each flag is resolved (generate
    kwarg > the `generation_config` argument > `model.generation_config` > off) and sent to forward explicitly.
    """

    def _prepare_generation_config(
        self, generation_config: GenerationConfig | None, **kwargs: Any
    ) -> tuple[GenerationConfig, dict[str, Any]]:
        call_flags = {name: kwargs.pop(name) for name in ATTENTION_FLAG_NAMES if name in kwargs}
        flags = resolve_attention_flags(
            call_flags, attention_flags_of(generation_config), attention_flags_of(self.generation_config)
        ).as_dict()
        if generation_config is not None:
            # Resolved values first, so transformers' merge of the model's defaults cannot refill them.
            generation_config = copy.deepcopy(generation_config)
            for name, value in flags.items():
                setattr(generation_config, name, value)
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        if generation_config.cache_implementation != "paged":  # continuous batching's steps take no such inputs
            _check_flags_reach_forward(type(self), flags, attention_flags_of(self.generation_config))
        for name, value in flags.items():
            setattr(generation_config, name, value)
        return generation_config, {**model_kwargs, **flags}

    def _get_stopping_criteria(
        self,
        generation_config: GenerationConfig,
        stopping_criteria: StoppingCriteriaList | None,
        tokenizer: Any = None,
    ) -> StoppingCriteriaList:
        """Stock's criteria, with `TailStopStringCriteria` for the stop strings: the same decision at every step,
        without `StopStringCriteria`'s tables over the whole vocabulary (seconds per new set of stop strings).

        A `StopStringCriteria` the caller passes takes precedence over the config's stop strings, as in stock.
        """
        stop_strings = generation_config.stop_strings
        if stop_strings is None or any(type(custom) is StopStringCriteria for custom in stopping_criteria or ()):
            return super()._get_stopping_criteria(generation_config, stopping_criteria, tokenizer)
        if tokenizer is None:
            # stock's words
            raise ValueError(
                "There are one or more stop strings, either in the arguments to `generate` or in the "
                "model's generation config, but we could not locate a tokenizer. When generating with "
                "stop strings, you must pass the model's tokenizer to the `tokenizer` argument of `generate`."
            )
        without = copy.copy(generation_config)
        without.stop_strings = None
        criteria = super()._get_stopping_criteria(without, StoppingCriteriaList(), tokenizer)
        criteria.append(TailStopStringCriteria(tokenizer, stop_strings))
        return self._merge_criteria_processor_list(criteria, stopping_criteria or StoppingCriteriaList())

    def _prepare_cache_for_generation(
        self,
        generation_config: GenerationConfig,
        model_kwargs: dict[str, Any],
        generation_mode: Any,
        batch_size: int,
        max_cache_length: int,
    ) -> None:
        """The cache transformers would build, replaced by one whose decode steps read its filled slots once.

        - a `DynamicCache` becomes a `GrowingCache`: appended in place (no copy of the whole cache per token), its
          storage never longer than the `max_cache_length` tokens it will hold;
        - a `StaticCache` becomes a `BucketedStaticCache` (a `StaticCache` of the same layers and length) attended
          over its filled slots: exactly when the step runs eagerly, in buckets of `STATIC_SHAPES_BUCKET` tokens
          when generate() compiles it (one graph per bucket);
        - on Gaudi, where shapes must stay static (lazy mode, HPU graphs), the default cache is that bucketed one,
          its window layers at the whole length too (a replayed graph never advances their Python count).
        A cache the caller passed, an offloaded one, a chunked prefill's, or one that would become bucketed in a
        generation that returns attention weights (their last dimension is the cache's length, which buckets
        change) is left as it is.
        """
        super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
        stock = model_kwargs.get("past_key_values")
        static_shapes = needs_static_shapes(next(self.parameters()))
        if (
            type(stock) not in (DynamicCache, StaticCache)
            or getattr(stock, "_is_user_defined", False)
            or stock.offloading
            or generation_config.prefill_chunk_size is not None
            or (generation_config.output_attentions and (type(stock) is StaticCache or static_shapes))
        ):
            return
        compiled = type(stock) is StaticCache and self._valid_auto_compile_criteria(model_kwargs, generation_config)
        # transformers' own length for a static cache (not `stock.get_max_length()`: a sliding-window or
        # linear-attention layer reports its window, or -1, and a model of only those would look full at once)
        max_cache_len = max(max_cache_length, generation_config.max_cache_len or 0)
        config = self.config.get_text_config(decoder=True)
        cache = generation_cache(
            config, type(stock), max_cache_length, max_cache_len, static_shapes=static_shapes, compiled=compiled
        )
        if cache is None:
            problem = static_cache_problem(config)
            warn_once(f"{problem}: generate() keeps the dynamic cache on Gaudi, one graph per decode step's shape.")
            return
        if generation_config.is_assistant:
            cache.activate_past_recording()
        model_kwargs["past_key_values"] = cache
