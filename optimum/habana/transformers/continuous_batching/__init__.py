"""transformers' continuous batching (`generate_batch`, `init_continuous_batching`, `transformers serve
--continuous-batching`) on a Gaudi model, with the Gaudi attention and its flags on every call.

transformers' engine accepts a model whose `config._attn_implementation` is "sdpa", "paged|eager" or a flash
implementation, builds a dense `[1, 1, q_total, kv_total]` mask per step for the first two, and passes its paged cache
to the attention, which writes and reads it. A Gaudi model keeps its layers on the Gaudi attention whatever that name
says (`AttentionConfigView`), so while a manager lives the config names what the engine must prepare: with
`use_flash_attention` on a model whose layers all attend fully, a name that asks for no mask (the attention isolates
the step's sequences from the engine's `cu_seq_lens_q`/`cu_seq_lens_k`, `batch_layout.py`); otherwise "sdpa", whose
mask carries the sliding windows and the default path reads. When the manager stops, the user's own choice comes
back unchanged, flags included.

The flags come from the `generation_config` given to the engine, then from the model's, as in `generate()`.
A request the engine would answer with an empty success, an unrelated scheduling error or a crash of the whole
batch (an empty prompt, a token id outside the vocabulary, a prompt and max_new_tokens past the model's context or
past the paged cache, max_new_tokens below 1) fails alone, with its reason in its result.

Sampling repeats with a seed (the engine config's `seed`, else the generation config's): the engine seeds torch's
generator when its batch processor is built, and `add_requests` queues a whole batch while the loop is paused, so
that every run schedules the same steps. `stop()` interrupts the requests still running when Ctrl-C is on its way
or its `timeout` runs out (transformers' flush would otherwise run them all to their end): they fail with
`RequestInterrupted`, their tokens so far in their result.
"""

import contextlib
import copy
import logging
import sys
from typing import Any

from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.continuous_api import (
    BackgroundThreadStatus,
    ContinuousBatchingManager,
)
from transformers.generation.continuous_batching.requests import RequestState

from ..attention_flags import ATTENTION_FLAG_NAMES, attention_flags_of, check_flag_spelling
from ..batch_layout import padding_mask_is_all_it_needs
from ..families.cache_facts import computes_with_cached_states, writes_cache_at_own_index
from ..families.lookups import attention_modules_of
from ..families.qualification import LATENT
from ..families.reports import family_report
from .capacity import cache_geometry, cached_tokens
from .failed_steps import StepIsolation


logger = logging.getLogger(__name__)


# The names the engine sees while a manager lives: it builds a dense 4-D mask per step for the first, none for the
# second (no mask function is registered under it, so the decoder builds none either).
CONTINUOUS_BATCHING_ATTENTION = "sdpa"
MASK_FREE_STEP_ATTENTION = "gaudi_mask_free_step"


def engine_attention(model: Any, flags: dict[str, bool] | None = None) -> str:
    """The name to present to the engine: mask-free where the flag's path reads none (`steps_run_mask_free`)."""
    if flags is None:
        flags = getattr(model, "_continuous_batching_flags", None) or attention_flags_of(model.generation_config)
    if steps_run_mask_free(bool(flags.get("use_flash_attention")), model.config, model.device.type):
        return MASK_FREE_STEP_ATTENTION
    return CONTINUOUS_BATCHING_ATTENTION


def steps_run_mask_free(use_flash_attention: bool, config: Any, device_type: str) -> bool:
    """Whether the engine builds no mask for its steps: with the flag, every layer full attention, off Gaudi (whose
    kernel reads the step's mask)."""
    return use_flash_attention and padding_mask_is_all_it_needs(config) and device_type != "hpu"


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
    seed = getattr(generation_config, "seed", None)  # not a documented GenerationConfig field; kept when set
    if config.seed is None and isinstance(seed, int) and not isinstance(seed, bool):
        config.seed = seed
    return config


def engine_flags(model_generation_config: Any, generation_config: Any) -> dict[str, bool]:
    """The flags of the engine's forwards: the given generation config's, then the model's."""
    return {**attention_flags_of(model_generation_config), **attention_flags_of(generation_config)}


def with_call_flags(generation_config: Any, model_generation_config: Any, kwargs: dict[str, Any]) -> Any:
    """`generate_batch`'s generation config with the attention flags among its keyword arguments, which stock's
    drops (it keeps `max_new_tokens` alone): a flag given per call, as to generate(), would do nothing. A copy of
    the given config (else the model's) with them set; the caller's is left as it was."""
    check_flag_spelling(kwargs)
    flags = {name: kwargs.pop(name) for name in ATTENTION_FLAG_NAMES if name in kwargs}
    if not flags:
        return generation_config
    config = copy.deepcopy(generation_config if generation_config is not None else model_generation_config)
    for name, value in flags.items():
        setattr(config, name, value)
    return config


class RequestRefused(ValueError):
    """Why a request cannot be served; its text is the failed result's `error`."""


class RequestInterrupted(RuntimeError):
    """A request still running when the manager was stopped (Ctrl-C, or `stop()`'s timeout ran out)."""


# How transformers' loop fails the requests left when it ends (continuous_api._run_generation_loop).
LOOP_FINISHED = "Generation loop finished before this request completed"


INTERRUPTED = (
    "interrupted: the continuous batching manager was stopped before this request completed; generated_tokens "
    "holds its tokens so far."
)


class StepFailed(Exception):
    """An engine step's forward raised: its requests fail, the engine goes on (`_generation_loop_body`)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class GaudiContinuousBatchingManager(ContinuousBatchingManager):
    """transformers' manager, presenting a Gaudi model to its engine and checking each request before it queues.

    transformers' loop treats an exception in a step's forward as fatal: every request, running or queued, fails,
    the loop ends, and a server built on it answers 503 from then on. Here a failed step fails the request that
    caused it (the error in its result, its tokens so far kept), found by trying the step's requests one at a time
    (`failed_steps.py`), and the loop goes on with the others.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._isolation = StepIsolation()
        self.engine_built_for: str | None = None  # the name its batch processor was built under

    def _create_batch_processor(self) -> Any:
        """transformers' batch processor, which decides once, when built, whether its steps carry a mask (it
        allocates the mask's buffers or none): a kept manager is rebuilt where new flags decide otherwise
        (`init_manager`)."""
        if getattr(self, "batch_processor", None) is None:
            self.engine_built_for = self.model.config._attn_implementation
        return super()._create_batch_processor()

    def switch_to_cb_friendly_attn(self, model: Any, auto_switch_to_flash: bool = True) -> None:
        chosen, presented = model.config._attn_implementation, engine_attention(model)
        if chosen != presented:
            model.config._attn_implementation_internal = presented
            if getattr(self, "_original_attn_impl", None) is None:  # a second switch keeps the user's choice
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
        problem = request_problem(list(input_ids), new_tokens, self.model, self.cache_capacity())
        if problem is None and new_tokens is None:  # "no limit" to transformers' engine: it ran past the context
            new_tokens = room_in_context(input_ids, self.model)  # until the cache ran out and failed the request
            if problem := request_problem(list(input_ids), new_tokens, self.model, self.cache_capacity()):
                problem = (
                    "max_new_tokens is not set, so this request may run to the end of the model's context "
                    f"({new_tokens} new tokens): {problem}"
                )
        if problem is None or not self.is_tp_driver:
            return super().add_request(input_ids, request_id=request_id, max_new_tokens=new_tokens, **kwargs)
        if request_id is None:
            with self._request_lock:
                request_id = f"req_{self._request_counter}"
                self._request_counter += 1
        logger.warning("Request %s refused: %s", request_id, problem)
        state = RequestState(request_id=request_id, initial_tokens=list(input_ids), max_new_tokens=new_tokens or 0)
        self.output_router.fail_and_deliver(state, RequestRefused(problem))
        return request_id

    def add_requests(self, inputs: list[list[int]], **kwargs: Any) -> list[str]:
        """transformers' `add_requests`, queued while the loop is paused: the loop sees the whole batch at once, so
        the steps it schedules (and the samples they draw) do not depend on thread timing."""
        with contextlib.ExitStack() as paused:
            if self.is_running():
                with contextlib.suppress(RuntimeError):  # the loop is gone: each request is reported as dropped
                    paused.enter_context(self.pause())
            return super().add_requests(inputs, **kwargs)

    def cache_capacity(self) -> tuple[int, int, int | None] | None:
        """(whole-model blocks, tokens per block, sectors) of the paged cache: the built cache's, else the config's
        request (its sectors then None: counted from the blocks as transformers will), else None."""
        cache = getattr(getattr(self, "batch_processor", None), "cache", None)
        blocks = getattr(cache, "num_blocks", None) or self.continuous_batching_config.num_blocks
        sectors = getattr(cache, "num_sectors", None)
        return None if blocks is None else (blocks, self.continuous_batching_config.page_size, sectors)

    def stop(self, block: bool = True, timeout: float | None = None, **kwargs: Any) -> None:
        """transformers' `stop`, which interrupts the running requests when Ctrl-C is on its way (a hard stop) or
        when `timeout` runs out before they end, instead of leaving the loop running them to their end."""
        hard_stop = kwargs.pop("hard_stop", False) or isinstance(sys.exc_info()[1], KeyboardInterrupt)
        thread = self._generation_thread
        if block and timeout is not None and not hard_stop and thread is not None:
            self.background_thread_status.request_stop(
                BackgroundThreadStatus.FLUSH_AND_STOP, self.distributed_helper.global_rank
            )
            thread.join(timeout)
            hard_stop = thread.is_alive()
        super().stop(block=block, timeout=None if hard_stop else timeout, hard_stop=hard_stop, **kwargs)

    def _generation_step(self) -> None:
        try:
            super()._generation_step()
        except Exception as error:
            raise StepFailed(error) from error

    def _generation_loop_body(self, batch_processor: Any, bootstrapping: bool) -> bool:
        try:
            going_on = super()._generation_loop_body(batch_processor, bootstrapping)
        except StepFailed as failed:
            if batch_processor.use_async_batching:  # a step in flight beside it: transformers' own handling
                raise failed.error from failed
            request_ids = [state.state.request_id for state in batch_processor.inputs_and_outputs.requests_in_batch]
            failed_ids = self._isolation.step_failed(batch_processor, failed.error)
            logger.error(
                "An engine step of requests %s failed (%s: %s): %s; the engine goes on with the others.",
                ", ".join(request_ids),
                type(failed.error).__name__,
                failed.error,
                f"request {failed_ids[0]} failed" if failed_ids else "each is tried again alone to find the cause",
                exc_info=failed.error,
            )
            batch_processor.scheduler.block_new_requests = False
            return True
        self._isolation.step_ran(batch_processor.scheduler)
        return going_on

    def _fail_all_remaining_requests(self, error: Exception, batch_processor: Any) -> None:
        """The requests a hard stop leaves fail with what happened, not the loop's internal status."""
        if str(error).startswith(LOOP_FINISHED):  # the loop's end, not a crash (whose error stays as it is)
            error = RequestInterrupted(INTERRUPTED)
        for suspect in self._isolation.release_all():  # held out of the scheduler: they fail with the others
            self.output_router.fail_and_deliver(suspect, error)
        super()._fail_all_remaining_requests(error, batch_processor)


def request_problem(
    input_ids: list[int], max_new_tokens: int | None, model: Any, cache: tuple[int, int, int | None] | None = None
) -> str | None:
    """What makes a request unservable, in words for its result, or None. `cache`: (whole-model blocks, tokens per
    block, sectors or None), as `cache_capacity` gives it."""
    if not input_ids:
        return "empty prompt: there is nothing to continue; send at least one token."
    if max_new_tokens is not None and max_new_tokens < 1:
        return f"max_new_tokens must be at least 1, got {max_new_tokens}."
    config = getattr(model, "config", model)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocabulary = getattr(embeddings, "num_embeddings", None) or getattr(config, "vocab_size", None)
    if vocabulary is not None and (bad := [token for token in input_ids if not 0 <= token < vocabulary]):
        which = f"token id {bad[0]} is" if len(bad) == 1 else f"{len(bad)} token ids (the first {bad[0]}) are"
        return f"{which} outside the model's vocabulary (0 to {vocabulary - 1}): tokenize with the model's tokenizer."
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and len(input_ids) >= context:
        return (
            f"the prompt has {len(input_ids)} tokens, as many as or more than the model's context of {context} "
            "(max_position_embeddings): shorten it."
        )
    if context is not None and max_new_tokens is not None and len(input_ids) + max_new_tokens > context:
        return (
            f"the prompt's {len(input_ids)} tokens and max_new_tokens {max_new_tokens} pass the model's context of "
            f"{context} positions (max_position_embeddings): lower max_new_tokens to at most "
            f"{context - len(input_ids)} or shorten the prompt."
        )
    if cache is not None and max_new_tokens is not None:
        blocks, page_size, sectors = cache
        geometry = cache_geometry(model, page_size)
        needed = geometry.sectors_for(cached_tokens(len(input_ids), max_new_tokens))
        if needed > (sectors or geometry.sectors_of(blocks)):
            least = geometry.blocks_for(needed)
            return (
                f"the paged cache is too small for this request: its {len(input_ids)} prompt tokens and "
                f"max_new_tokens {max_new_tokens} need {least} blocks of {page_size} tokens, the cache holds "
                f"{blocks}. Size it with ContinuousBatchingConfig(num_blocks=...) (serve: --cb-num-blocks) of at "
                f"least {least}, or lower max_new_tokens."
            )
    return None


def room_in_context(input_ids: list[int], model: Any) -> int | None:
    """New tokens left before a prompt reaches the model's context (`max_position_embeddings`): where a request
    without max_new_tokens stops, as the server's do. None where the config names no context."""
    context = getattr(getattr(model, "config", model), "max_position_embeddings", None)
    return None if context is None else context - len(input_ids)


def check_engine_serves(model: Any, remedy: str = "Use generate() for this model.") -> None:
    """Refuse, in one line and before any request, a family transformers' engine cannot serve (`remedy`: what the
    caller's user does instead, in the caller's words: a script's option). Its paged cache holds
    full and sliding-window attention layers of one geometry, `config.head_dim` per head: latent attention (keys and
    values of other sizes: stock fails every request), several attention calls per layer (each would write the
    cache: stock gives wrong tokens), other layer kinds (linear attention, chunked or indexed attention) and per-layer
    geometry are refused by the engine itself, deep inside it."""
    config = model.config
    name = type(model).__name__
    report = family_report(config.model_type)
    attention_types = {type(module) for module in attention_modules_of(model)}
    if LATENT in report.variants:
        problem = "its latent attention keeps keys and values of other sizes than config.head_dim, which the paged cache holds"
    elif report.calls_per_attention > 1:
        problem = (
            f"its attention calls the attention function {report.calls_per_attention} times per layer, with other "
            "values each time, and every call writes them into the engine's paged cache (stock transformers gives "
            "wrong tokens there)"
        )
    elif computed := sorted({name for kind in attention_types for name in computes_with_cached_states(kind)}):
        problem = (
            f"its attention computes with the cached {' and '.join(computed)} outside the attention function (a "
            "repeat of the key/value heads, a mask made from the values), and in the engine the attention function "
            "alone holds the paged cache (stock transformers fails every request there)"
        )
    elif other := sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}):
        problem = f"its layers of kind {', '.join(other)} have no paged cache (only full and sliding-window attention)"
    elif getattr(config, "is_heterogeneous", False):
        problem = "its head counts and sizes vary per layer, and the paged cache holds one geometry"
    elif not all(writes_cache_at_own_index(kind) for kind in attention_types):
        problem = (
            "its attention writes the cache at layers offset from its own index (a recurrent stack run several "
            "times per forward), which the engine's paged cache does not follow (stock transformers gives wrong "
            "tokens there)"
        )
    else:
        return
    raise ValueError(f"{name} cannot run in transformers' continuous batching: {problem}. {remedy}")


def init_manager(
    model: Any,
    flags: dict[str, bool],
    generation_config: GenerationConfig | None,
    continuous_batching_config: ContinuousBatchingConfig | None,
    workload_hints: Any,
) -> ContinuousBatchingManager:
    """`init_continuous_batching` as transformers does it, with the Gaudi manager running with `flags`.

    transformers hands back a kept manager (`persistent_manager=True`) as it is; its engine is built again where
    these flags need steps of the other kind (with a mask or without) than it was built for."""
    check_engine_serves(model)
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, ContinuousBatchingManager):
        fit_kept_engine(cached, model, flags)
        model._continuous_batching_flags = flags
        cached.switch_to_cb_friendly_attn(model, False)
        return cached
    model._continuous_batching_flags = flags
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


def fit_kept_engine(manager: ContinuousBatchingManager, model: Any, flags: dict[str, bool]) -> None:
    """Drop a kept manager's batch processor built for steps of the other kind than `flags` need, so that its next
    start builds one for them: the flag off on an engine built without masks would run the default path unmasked."""
    built_for, wanted = getattr(manager, "engine_built_for", None), engine_attention(model, flags)
    if getattr(manager, "batch_processor", None) is None or built_for in (None, wanted):
        return
    steps = "without a mask" if wanted == MASK_FREE_STEP_ATTENTION else "with the mask the default path reads"
    if manager.is_running():
        raise ValueError(
            f"use_flash_attention={bool(flags.get('use_flash_attention'))} runs this model's engine steps {steps}, "
            "and the continuous batching manager kept on this model is running an engine built otherwise: stop it "
            "(manager.stop()) before asking for other flags, or pass the flags it runs with."
        )
    logger.warning(
        "use_flash_attention=%s runs this model's engine steps %s: the kept continuous batching manager's engine, "
        "built otherwise, is built again (its paged cache with it).",
        bool(flags.get("use_flash_attention")),
        steps,
    )
    manager.batch_processor = None


__all__ = [
    "CONTINUOUS_BATCHING_ATTENTION",
    "MASK_FREE_STEP_ATTENTION",
    "ChosenAttnImplementation",
    "GaudiContinuousBatchingManager",
    "RequestInterrupted",
    "RequestRefused",
    "StepFailed",
    "check_engine_serves",
    "engine_attention",
    "engine_config",
    "engine_flags",
    "fit_kept_engine",
    "init_manager",
    "request_problem",
    "room_in_context",
    "steps_run_mask_free",
    "with_call_flags",
]
