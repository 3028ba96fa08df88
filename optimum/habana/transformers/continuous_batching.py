"""transformers' continuous batching (`generate_batch`, `init_continuous_batching`, `transformers serve
--continuous-batching`) on a Gaudi model, with the Gaudi attention and its flags on every call.

transformers' engine accepts a model whose `config._attn_implementation` is "sdpa", "paged|eager" or a flash
implementation, builds a 4-D mask per batch for the first two, and passes its paged cache to the attention, which
writes and reads it. A Gaudi model keeps its layers on the Gaudi attention whatever that name says
(`AttentionConfigView`), so while a manager lives the config says "sdpa": the engine builds its masks, and the Gaudi
attention updates the paged cache and runs the fused kernel (with `use_flash_attention`) or the default path over
them. When the manager stops, the user's own choice comes back unchanged, flags included.

The flags come from the `generation_config` given to the engine, then from the model's, as in `generate()`.
A request the engine would answer with an empty success or an unrelated scheduling error (an empty prompt, one
longer than the model's context, max_new_tokens below 1) fails alone, with its reason in its result.
"""

import copy
import logging
from typing import Any

from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
from transformers.generation.continuous_batching.requests import RequestState

from .attention_flags import attention_flags_of


logger = logging.getLogger(__name__)


# The name the engine sees while a manager lives: it builds a 4-D mask per batch for it.
CONTINUOUS_BATCHING_ATTENTION = "sdpa"


class ChosenAttnImplementation(str):
    """The user's `attn_implementation`, handed back by the engine when its manager stops: restored as it was,
    without re-deriving the flags from it (`GaudiAttentionMixin.set_attn_implementation`)."""


def engine_config(
    continuous_batching_config: ContinuousBatchingConfig | None, generation_config: GenerationConfig | None
) -> ContinuousBatchingConfig:
    """The engine's config with `auto_switch_to_flash` off: the Gaudi attention runs every call, and a switch to a
    flash implementation would take the layers away from it."""
    if continuous_batching_config is None:  # transformers' deprecated route, through the generation config
        continuous_batching_config = getattr(generation_config, "continuous_batching_config", None)
    config = copy.deepcopy(continuous_batching_config) if continuous_batching_config else ContinuousBatchingConfig()
    config.auto_switch_to_flash = False
    return config


def engine_flags(model_generation_config: Any, generation_config: Any) -> dict[str, bool]:
    """The flags of the engine's forwards: the given generation config's, then the model's."""
    return {**attention_flags_of(model_generation_config), **attention_flags_of(generation_config)}


class RequestRefused(ValueError):
    """Why a request cannot be served; its text is the failed result's `error`."""


class GaudiContinuousBatchingManager(ContinuousBatchingManager):
    """transformers' manager, presenting a Gaudi model to its engine and checking each request before it queues."""

    def switch_to_cb_friendly_attn(self, model: Any, auto_switch_to_flash: bool = True) -> None:
        chosen = model.config._attn_implementation
        if chosen != CONTINUOUS_BATCHING_ATTENTION:
            model.config._attn_implementation_internal = CONTINUOUS_BATCHING_ATTENTION
            # The engine hands this back to set_attn_implementation when it stops.
            self._original_attn_impl = ChosenAttnImplementation(chosen)

    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        **kwargs: Any,
    ) -> str | None:
        new_tokens = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        problem = request_problem(list(input_ids), new_tokens, self.model.config)
        if problem is None or not self.is_tp_driver:
            return super().add_request(input_ids, request_id=request_id, max_new_tokens=max_new_tokens, **kwargs)
        if request_id is None:
            with self._request_lock:
                request_id = f"req_{self._request_counter}"
                self._request_counter += 1
        logger.warning("Request %s refused: %s", request_id, problem)
        state = RequestState(request_id=request_id, initial_tokens=list(input_ids), max_new_tokens=new_tokens or 0)
        self.output_router.fail_and_deliver(state, RequestRefused(problem))
        return request_id


def request_problem(input_ids: list[int], max_new_tokens: int | None, config: Any) -> str | None:
    """What makes a request unservable, in words for its result, or None."""
    if not input_ids:
        return "empty prompt: there is nothing to continue; send at least one token."
    if max_new_tokens is not None and max_new_tokens < 1:
        return f"max_new_tokens must be at least 1, got {max_new_tokens}."
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and len(input_ids) >= context:
        return (
            f"the prompt has {len(input_ids)} tokens, as many as or more than the model's context of {context} "
            "(max_position_embeddings): shorten it."
        )
    return None


def init_manager(
    model: Any,
    generation_config: GenerationConfig | None,
    continuous_batching_config: ContinuousBatchingConfig | None,
    workload_hints: Any,
) -> ContinuousBatchingManager:
    """`init_continuous_batching` as transformers does it, with the Gaudi manager."""
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, ContinuousBatchingManager):
        cached.switch_to_cb_friendly_attn(model, False)
        return cached
    generation_config = generation_config if generation_config is not None else model.generation_config
    if generation_config.eos_token_id is None:
        logger.warning("`eos_token_id` not set in the generation config: requests stop at max_new_tokens only.")
        generation_config.eos_token_id = -1
    return GaudiContinuousBatchingManager(
        model=model,
        generation_config=generation_config,
        continuous_batching_config=engine_config(continuous_batching_config, generation_config),
        workload_hints=workload_hints,
    )


__all__ = [
    "CONTINUOUS_BATCHING_ATTENTION",
    "ChosenAttnImplementation",
    "GaudiContinuousBatchingManager",
    "RequestRefused",
    "engine_config",
    "engine_flags",
    "init_manager",
    "request_problem",
]
