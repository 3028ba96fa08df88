"""A request's preparation, off the server's event loop and bounded: no request can hold the other clients.

transformers' handlers template and tokenize a prompt on the event loop, so every client waits while one prompt is
read: a 50 MB chat body held `/health` for 118 s (and 6.5 GB of memory), 2,048 messages of 6,000 characters 23 s.
Here, after the body limit (`app.BodyLimit`) and the request model (`bodies`):

- `check_prompt_length`: a prompt of more characters than the context holds tokens times the characters of the
  vocabulary's longest token cannot fit, and is refused by its length alone, before anything templates or tokenizes
  it (a 400 `context_length_exceeded`; memory stays where it was);
- `off_the_loop`: transformers' handler (templating, tokenizing, the generation settings, decoding the answer)
  runs in a worker thread, on an event loop of its own; its calls into the generation managers (`OnServerLoop`),
  whose queues and callbacks belong to the server's event loop, are made on that loop;
- `give_back_freed_memory`: after a refused request, what it freed goes back to the system (`app.RequestWatch`).
"""

import asyncio
import contextvars
import ctypes
import functools
import sys
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .checks import RequestError, ServedModel


SERVER_LOOP: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "gaudi_serve_loop", default=None
)
HOP_TIMEOUT_S = 60  # a call made on the server's loop for a worker thread (it takes milliseconds)


def longest_token(tokenizer: Any) -> int:
    """The most characters one token of the vocabulary stands for (special and added tokens included)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    texts = tokenizer.batch_decode([[index] for index in range(len(tokenizer))], skip_special_tokens=False)
    return max((len(text) for text in texts), default=1) or 1


def check_prompt_length(request: Any, served: ServedModel) -> None:
    """Refuse a prompt that cannot fit the context whatever it tokenizes to: each token stands for at most
    `served.longest_token` characters."""
    if served.context_length is None or served.longest_token is None:
        return
    characters = request.prompt_characters()
    most = served.context_length * served.longest_token
    if characters > most:
        asked = request.token_request()
        raise RequestError(
            f"This model's maximum context length is {served.context_length} tokens, and no token of its vocabulary "
            f"stands for more than {served.longest_token} characters, so a prompt of more than {most} characters "
            f"cannot fit. However, your {asked.prompt} hold {characters} characters. Please reduce the length of the "
            f"{asked.prompt}.",
            asked.prompt,
            "context_length_exceeded",
        )


# A request holds its thread until transformers' handler returns: a stream once it starts, a whole answer once it is
# generated (the thread then waits, idle, with its event loop's 3 file descriptors). asyncio's default pool
# (min(32, cores + 4) threads: 6 here) held a continuous-batching server to 6 whole answers at once; beyond these,
# requests wait for a thread.
REQUEST_THREADS = 128


@functools.cache
def request_threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=REQUEST_THREADS, thread_name_prefix="serve-request")


async def off_the_loop(coroutine: Coroutine) -> Any:
    """The coroutine's result, run in a worker thread on an event loop of its own (in this context)."""
    loop = asyncio.get_running_loop()
    token = SERVER_LOOP.set(loop)
    try:
        return await loop.run_in_executor(request_threads(), contextvars.copy_context().run, asyncio.run, coroutine)
    finally:
        SERVER_LOOP.reset(token)


@functools.cache
def malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, where the C library has it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def give_back_freed_memory() -> None:
    """The memory freed by a refused request (a prompt tokenized, then refused as too long) back to the system:
    glibc keeps it otherwise (450 MB after a prompt of 2M characters)."""
    trim = malloc_trim()
    if trim is not None:
        trim(0)


def elsewhere() -> asyncio.AbstractEventLoop | None:
    """The server's event loop when the caller runs off it (in `off_the_loop`), else None."""
    loop = SERVER_LOOP.get()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    return None if loop is None or running is loop else loop


async def call(function: Callable[[], Any]) -> Any:
    return function()


class OnServerLoop:
    """Mixed in before a generation manager: its two entry points run on the server's event loop, whichever thread
    calls them (their queues, streamers and callbacks are that loop's)."""

    def generate_streaming(self, *args: Any, **kwargs: Any) -> Any:
        loop = elsewhere()
        start = functools.partial(super().generate_streaming, *args, **kwargs)
        if loop is None:
            return start()
        return asyncio.run_coroutine_threadsafe(call(start), loop).result(HOP_TIMEOUT_S)

    async def generate_non_streaming(self, *args: Any, **kwargs: Any) -> Any:
        loop = elsewhere()
        generation = super().generate_non_streaming(*args, **kwargs)
        if loop is None:
            return await generation
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(generation, loop))
