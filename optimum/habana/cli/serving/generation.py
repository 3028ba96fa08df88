"""Bounded, cancellable generation: transformers' generation managers with a length check and a way to stop.

transformers' managers generate what they are asked: `max_tokens` 1e6 holds the sequential path for minutes, a
prompt past the model's positions is answered anyway, one request longer than the paged cache kills the
continuous-batching worker (every later request is a 503), and a non-streaming request runs to its end after its
client is gone. Here, before a request reaches them:

- its prompt and `max_tokens` must fit the context (the model's positions, and with continuous batching the paged
  cache), else a 400 `context_length_exceeded` in OpenAI's words; without `max_tokens` it gets what the context
  leaves, so that no generation is unbounded;
- its generation stops when its client disconnects or the server shuts down (`InFlight`): a stream ends with an
  error event, a non-streaming request with a 503 (shutdown) or nothing (its client is gone).

The request's `InFlight` and its asked length reach the managers through context variables: transformers' handlers
call the managers with the tokenized prompt and the generation config only.
"""

import asyncio
import contextvars
import copy
import logging
import threading
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, StoppingCriteria, StoppingCriteriaList
from transformers.cli.serving.utils import (
    CBGenerateManager,
    CBWorkerDeadError,
    GenerateManager,
    GenerationState,
    _StreamError,
)

from .cache import wait_for_cache
from .checks import RequestError, TokenRequest
from .preparation import OnServerLoop


logger = logging.getLogger(__name__)


SHUTDOWN = "shutdown"
DISCONNECT = "disconnect"
SHUTDOWN_MESSAGE = "The server is shutting down: this request was cancelled before it finished. Send it again later."


class InFlight:
    """One request being served, which its client's disconnect or the server's shutdown cancels."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.reason: str | None = None
        self.finished = False
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self.reason is not None

    def cancel(self, reason: str) -> None:
        """Stop the request's generation (once; a finished request is left alone)."""
        with self._lock:
            if self.reason is not None or self.finished:
                return
            self.reason, callbacks = reason, list(self._callbacks)
        logger.warning("Request %s cancelled: %s.", self.request_id, reason)
        for callback in callbacks:
            callback(reason)

    def on_cancel(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            if self.reason is None:
                self._callbacks.append(callback)
                return
        callback(self.reason)


class InFlightRequests:
    """The server's open requests, so that shutting down cancels each of them."""

    def __init__(self) -> None:
        self._open: dict[str, InFlight] = {}
        self._lock = threading.Lock()

    def open(self, request_id: str | None) -> InFlight | None:
        """A new request's `InFlight`, or None when a request of that id is already in flight."""
        request_id = request_id or str(uuid.uuid4())
        with self._lock:
            if request_id in self._open:
                return None
            flight = self._open[request_id] = InFlight(request_id)
        return flight

    def close(self, flight: InFlight) -> None:
        with self._lock:
            self._open.pop(flight.request_id, None)

    def cancel_all(self, reason: str) -> int:
        with self._lock:
            flights = list(self._open.values())
        for flight in flights:
            flight.cancel(reason)
        return len(flights)


CURRENT_FLIGHT: contextvars.ContextVar[InFlight | None] = contextvars.ContextVar("gaudi_serve_flight", default=None)
CURRENT_TOKENS: contextvars.ContextVar[TokenRequest | None] = contextvars.ContextVar(
    "gaudi_serve_tokens", default=None
)


def cancellation_error(reason: str) -> RequestError:
    if reason == SHUTDOWN:
        return RequestError(SHUTDOWN_MESSAGE, None, "server_shutting_down", 503)
    return RequestError("The client disconnected: its generation was cancelled.", None, "client_disconnected", 499)


def context_length(model: PreTrainedModel) -> int | None:
    """The model's positions (`max_position_embeddings` or its equivalent), None where the config names none."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(value := getattr(config, name, None), int) and value > 0:
            return value
    return None


def bound_generation(
    model: PreTrainedModel, inputs: Any, gen_config: GenerationConfig, cache: tuple[int, int] | None = None
) -> None:
    """Refuse a request whose prompt and completion pass the context; give one without `max_tokens` the rest of it.

    `cache`: (blocks, tokens per block) of the continuous-batching cache, which bounds one request too.
    """
    request = CURRENT_TOKENS.get()
    if request is None:  # an endpoint that checks nothing (transformers' own handlers)
        return
    ids = inputs["input_ids"]
    prompt = len(ids) if isinstance(ids, list) else int(ids.shape[-1])
    if prompt == 0:
        raise RequestError(f"The {request.prompt} tokenized to no tokens: send some text.", request.prompt)
    context = context_length(model)
    limit, whose = context, "This model's"
    if cache is not None and (limit is None or cache[0] * cache[1] < limit):
        blocks, page = cache
        limit = blocks * page
        whose = (
            f"This server's KV cache ({blocks} blocks of {page} tokens: --cb-num-blocks, --cb-block-size) is smaller "
            f"than the model's context{f' of {context} tokens' if context else ''}; its"
        )
    if limit is None:
        return  # transformers' default length stays
    max_tokens = request.max_tokens if request.max_tokens is not None else limit - prompt
    if max_tokens < 1 or prompt + max_tokens > limit:
        if request.max_tokens is None or prompt >= limit:
            detail = f"your {request.prompt} resulted in {prompt} tokens, which leaves no room for the completion"
            advice, param = f"Please reduce the length of the {request.prompt}.", request.prompt
        else:
            detail = (
                f"you requested {prompt + max_tokens} tokens ({prompt} in the {request.prompt}, {max_tokens} in the "
                "completion)"
            )
            advice = (
                f"Please reduce the length of the {request.prompt} or completion (`{request.param}` at most "
                f"{limit - prompt} for these {request.prompt})."
            )
            param = request.param
        raise RequestError(
            f"{whose} maximum context length is {limit} tokens. However, {detail}. {advice}",
            param,
            "context_length_exceeded",
        )
    if (gen_config.min_new_tokens or 0) > max_tokens:  # only where max_tokens was left out (checks)
        raise RequestError(
            f"`generation_config.min_new_tokens` {gen_config.min_new_tokens} is above the {max_tokens} tokens the "
            f"context leaves for the completion ({prompt} in the {request.prompt}, of {limit}). Lower it.",
            "generation_config.min_new_tokens",
            "context_length_exceeded",
        )
    gen_config.max_new_tokens = max_tokens


class StopWhenCancelled(StoppingCriteria):
    """generate()'s stop for a request cancelled mid-way (a non-streaming one has no streamer to raise from)."""

    def __init__(self, flight: InFlight) -> None:
        self.flight = flight

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.flight.cancelled, dtype=torch.bool, device=input_ids.device)


def watch_stream(queue: asyncio.Queue, streamer: Any) -> None:
    """A cancelled stream stops its generation and, on shutdown, ends with an error event."""
    flight = CURRENT_FLIGHT.get()
    if flight is None:
        return
    loop = asyncio.get_running_loop()

    def cancel(reason: str) -> None:
        streamer.cancel()
        if reason == SHUTDOWN:
            loop.call_soon_threadsafe(queue.put_nowait, _StreamError(SHUTDOWN_MESSAGE))

    flight.on_cancel(cancel)


async def until_cancelled(generation: Awaitable, cancel: Callable[[], None] | None = None) -> Any:
    """The generation's result, or the request's cancellation error as soon as it is cancelled.

    `cancel`: what stops the generation besides the flight (continuous batching's `cancel_request`); without it the
    generation stops by itself (generate()'s stopping criteria) and is left to finish, unawaited.
    """
    flight = CURRENT_FLIGHT.get()
    if flight is None:
        return await generation
    loop = asyncio.get_running_loop()
    cancelled: asyncio.Future = loop.create_future()

    def settle(reason: str) -> None:
        if not cancelled.done():
            cancelled.set_result(reason)

    flight.on_cancel(lambda reason: loop.call_soon_threadsafe(settle, reason))
    task = asyncio.ensure_future(generation)
    task.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved, whoever waits
    try:
        await asyncio.wait({task, cancelled}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # uvicorn's graceful-shutdown timeout
        flight.cancel(SHUTDOWN)
        raise
    if flight.reason is None:  # finished (a generation stopped by a cancellation is not an answer)
        cancelled.cancel()
        return task.result()
    if cancel is not None:
        task.cancel()
        cancel()
    raise cancellation_error(flight.reason)


# A request's `stop` strings are cut from its answer as OpenAI's API does ("The returned text will not contain the
# stop sequence"). transformers' server hands `stop` to generate() as `stop_strings`, which ends generation once one
# appears in the tokens, and answered the whole decoded text: the stop string, and the rest of the token that
# completed it, included. A whole answer is cut before the first stop string; a stream holds back the text that may
# be the start of one until the next text shows whether it is, and ends where one begins.


def stop_strings_of(gen_config: Any) -> tuple[str, ...]:
    stops = getattr(gen_config, "stop_strings", None)
    if stops is None:
        return ()
    return tuple(stop for stop in ([stops] if isinstance(stops, str) else stops) if stop)


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """The text before the first stop string, and whether one was found."""
    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return (text[: min(found)], True) if found else (text, False)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may begin a stop string that the next text would complete."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class StopStringQueue:
    """A stream's queue as transformers' handlers read it (`get`, `get_nowait`), its text cut at the stop strings.

    Items other than text (the end, `None`; errors; tool calls and reasoning, which are not plain `str`) pass as they
    come, after the text held back before them.
    """

    def __init__(
        self, source: asyncio.Queue, stops: tuple[str, ...], on_stop: Callable[[], None] = lambda: None
    ) -> None:
        self.source, self.stops, self.on_stop = source, stops, on_stop
        self.pending = ""  # text that may begin a stop string
        self.stopped = False
        self.ready: deque = deque()

    async def get(self) -> Any:
        while not self.ready:
            self.take(await self.source.get())
        return self.ready.popleft()

    def get_nowait(self) -> Any:
        while not self.ready:
            self.take(self.source.get_nowait())  # asyncio.QueueEmpty when nothing has come
        return self.ready.popleft()

    def take(self, item: Any) -> None:
        if self.stopped:  # generation ends by itself past a stop string; what it still sends is not the answer's
            return
        if type(item) is not str:
            if self.pending:
                self.ready.append(self.pending)
                self.pending = ""
            self.ready.append(item)
            return
        text, found = cut_at_stop(self.pending + item, self.stops)
        if found:
            self.stopped = True
            self.on_stop()  # a stop string generate()'s own criterion missed (no token spells it): nothing more is read
            self.ready.extend([text, None] if text else [None])
            self.pending = ""
            return
        keep = held_back(text, self.stops)
        self.pending = text[len(text) - keep :] if keep else ""
        if text[: len(text) - keep]:
            self.ready.append(text[: len(text) - keep])


class BoundedStreaming:
    """Mixed in before a transformers manager: a stream is bounded by the context (and the paged cache, where the
    manager has one), watched for the client going away, and ends before the request's stop strings."""

    def cache(self) -> tuple[int, int] | None:
        return None

    def generate_streaming(
        self,
        model: PreTrainedModel,
        processor: Any,
        inputs: Any,
        gen_config: GenerationConfig,
        request_id: str,
        response_parser: Any = None,
    ) -> tuple[asyncio.Queue | StopStringQueue, Any]:
        bound_generation(model, inputs, gen_config, self.cache())
        queue, streamer = super().generate_streaming(model, processor, inputs, gen_config, request_id, response_parser)
        watch_stream(queue, streamer)
        stops = stop_strings_of(gen_config)
        return (StopStringQueue(queue, stops, on_stop=streamer.cancel) if stops else queue), streamer


class BoundedGenerateManager(BoundedStreaming, GenerateManager):
    """transformers' sequential manager (generate() on one thread), bounded and cancellable; its answers end before
    the request's stop strings (`stop_strings`: continuous batching refuses `stop`)."""

    async def generate_non_streaming(
        self, model: PreTrainedModel, processor: Any, inputs: Any, gen_config: GenerationConfig, request_id: str
    ) -> tuple[str, int, Any]:
        bound_generation(model, inputs, gen_config)
        if (flight := CURRENT_FLIGHT.get()) is not None:
            inputs = {**inputs, "stopping_criteria": StoppingCriteriaList([StopWhenCancelled(flight)])}
        generation = super().generate_non_streaming(model, processor, inputs, gen_config, request_id)
        text, prompt_length, generated = await until_cancelled(generation)
        return cut_at_stop(text, stop_strings_of(gen_config))[0], prompt_length, generated


def shared_generation_config(model_config: GenerationConfig) -> GenerationConfig:
    """The generation settings a continuous-batching engine shares among its requests: the model's generation config
    with the server's flags (transformers takes those of whichever request starts the engine)."""
    config = copy.deepcopy(model_config)
    config.use_cache = False  # the engine's paged cache
    return config


class BoundedCBGenerateManager(BoundedStreaming, CBGenerateManager):
    """transformers' continuous-batching manager, which refuses what its cache cannot hold, and cancels; its engine
    runs with the server's generation settings, whichever request comes first, and is known to serve once started:
    `init_cb` returns when its paged cache is built, or raises CBWorkerDeadError saying why it could not be (a 503;
    transformers' first requests got a 500 and later ones waited on a worker that had died).

    Once stopped it starts nothing: a request handed this manager before it was stopped gets its error at once,
    where it waited for the stopped engine's cache until the build timeout (and started an engine that nothing would
    stop, where none had started yet)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._starting = threading.Lock()  # a start and a stop, one after the other
        self._stopped_for: str | None = None

    def init_cb(self, model: PreTrainedModel, gen_config: GenerationConfig | None = None) -> None:
        with self._starting:
            if self._stopped_for == SHUTDOWN:
                raise cancellation_error(SHUTDOWN)
            if self._stopped_for is not None:
                raise CBWorkerDeadError("The continuous-batching engine this request was given has stopped.")
            super().init_cb(model, shared_generation_config(model.generation_config))
        wait_for_cache(self)  # at once where it was built

    def stop(self, reason: str = "replaced") -> None:
        with self._starting:
            self._stopped_for = reason
        super().stop()

    def cache(self) -> tuple[int, int] | None:
        """(blocks, tokens per block) of the paged cache: the built one's, else the configured, else unknown."""
        if self._cb is None:
            return None
        config = getattr(self._cb, "continuous_batching_config", None)
        built = getattr(getattr(getattr(self._cb, "batch_processor", None), "cache", None), "num_blocks", None)
        blocks = built or getattr(config, "num_blocks", None)
        page = getattr(config, "page_size", None)
        return (blocks, page) if blocks and page else None

    async def generate_non_streaming(
        self, model: PreTrainedModel, processor: Any, inputs: Any, gen_config: GenerationConfig, request_id: str
    ) -> tuple[str, int, Any]:
        bound_generation(model, inputs, gen_config, self.cache())
        generation = super().generate_non_streaming(model, processor, inputs, gen_config, request_id)
        return await until_cancelled(generation, cancel=lambda: self._cb.cancel_request(request_id))


class GaudiGenerateManager(OnServerLoop, BoundedGenerateManager):
    """The sequential manager, its generations started on the server's event loop (`preparation`)."""


class GaudiCBGenerateManager(OnServerLoop, BoundedCBGenerateManager):
    """The continuous-batching manager, its requests added on the server's event loop (`preparation`)."""


class GaudiGenerationState(GenerationState):
    """transformers' generation state with the managers above, which handlers running in worker threads ask for
    under a lock (two sequential managers would generate at once); a continuous-batching worker that died is
    replaced at the next request (transformers answers 503 to every request from then on). Once shut down it hands
    out no manager: a request that asks for one then gets a 503, not an engine started that nothing would stop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._shut_down = False

    def get_manager(self, model_id: str, use_cb: bool = False) -> Any:
        with self._lock:
            if self._shut_down:
                raise cancellation_error(SHUTDOWN)
            if use_cb and self._cb_manager is not None and not self._cb_manager.is_alive():
                logger.warning("The continuous-batching worker died; the next request starts a new one.")
                self._cb_manager.stop()
                self._cb_manager = None
            if use_cb and (self._cb_manager is None or self._cb_model_id != model_id):
                if self._cb_manager is not None:
                    self._cb_manager.stop()
                self._cb_manager, self._cb_model_id = GaudiCBGenerateManager(cb_config=self._cb_config), model_id
            if not use_cb and model_id not in self._generate_managers:
                self._generate_managers[model_id] = GaudiGenerateManager()
            return super().get_manager(model_id, use_cb=use_cb)

    def shutdown(self) -> None:
        with self._lock:
            self._shut_down = True
            if self._cb_manager is not None:
                self._cb_manager.stop(SHUTDOWN)
                self._cb_manager = None
