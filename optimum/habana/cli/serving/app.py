"""What GaudiServe adds to the app transformers' `build_server` returns, and the uvicorn server that runs it.

- Errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`): the request models' validation
  errors and the checks' `RequestError`s (`checks`), the HTTP errors transformers and FastAPI raise (404, ...), a
  dead continuous-batching worker (503), and anything unexpected (500, its traceback in the log).
- `ApiKey`, an ASGI middleware that, with `--api-key`, answers 401 to every request but `/health` that does not
  carry `Authorization: Bearer <key>` (the scheme in any case, as HTTP allows; the key compared in constant time).
- `BodyLimit`, an ASGI middleware that answers 413 to a body above `--max-body-bytes` before reading it whole: by
  its declared length at once, else as soon as what arrived passes the limit.
- `RequestWatch`, an ASGI middleware around every generation request: it keeps the request's `InFlight` (see
  `generation`) and cancels it when the client disconnects, which transformers notices for streams only; two
  requests in flight under the same `x-request-id` would share one continuous-batching slot, so the second is
  refused.
- `GracefulServer`, uvicorn's server that cancels every request in flight as it starts shutting down (SIGTERM,
  Ctrl-C): streams end with an error event and `[DONE]`, other requests get a 503, and the process exits in
  seconds instead of waiting for generations to run to their end. `SHUTDOWN_GRACE_S` bounds the rest.
"""

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from transformers.cli.serving.utils import X_REQUEST_ID, CBWorkerDeadError

from .bodies import BODIES
from .checks import RequestError, ServedModel, error_body, openai_error
from .generation import CURRENT_FLIGHT, DISCONNECT, InFlight, InFlightRequests
from .preparation import give_back_freed_memory
from .routes import GENERATION_PATHS


logger = logging.getLogger(__name__)


OPEN_PATHS = frozenset({"/health"})  # what answers without the API key
SHUTDOWN_GRACE_S = 5  # after in-flight requests were cancelled, what uvicorn waits for before cancelling its tasks


def install(app: FastAPI, requests: InFlightRequests, api_key: str | None, body_limit: int) -> None:
    """The error handlers, the request watch, the body limit and the key, on this app only (transformers' other apps
    are untouched)."""
    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, body_error)
    app.add_exception_handler(CBWorkerDeadError, worker_dead)
    app.add_exception_handler(Exception, unexpected_error)
    app.add_middleware(RequestWatch, requests=requests)
    app.add_middleware(BodyLimit, limit=body_limit)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)  # the outermost: nothing runs for a request without the key


async def request_error(_request: Request, error: RequestError) -> JSONResponse:
    if error.status < 499:
        logger.warning("Refused (%d): %s", error.status, error.message)
    return JSONResponse(error.body(), status_code=error.status)


async def http_error(request: Request, error: HTTPException) -> JSONResponse:
    detail = error.detail if isinstance(error.detail, str) else str(error.detail)
    if error.status_code == 400 and detail == "There was an error parsing the body":  # FastAPI's words
        if isinstance(error.__cause__, BodyTooLarge):  # a route that reads its body itself
            return too_large_answer(error.__cause__.limit)
        detail = f"The request body could not be read as JSON: {unreadable_json(error.__cause__)}."
    if error.status_code == 404 and detail == "Not Found":
        detail = (
            f"{request.url.path} is not served here: this server serves a text model at /v1/chat/completions, "
            "/v1/completions, /v1/responses and /v1/models (/reset and /load_model need --enable-admin-routes)."
        )
    return JSONResponse(error_body(detail, error.status_code), status_code=error.status_code, headers=error.headers)


def unreadable_json(cause: BaseException | None) -> str:
    """Why Python's JSON parser could not read a body (FastAPI calls each "an error parsing the body")."""
    if isinstance(cause, RecursionError):
        return "its arrays or objects nest deeper than the parser allows (about 1000 levels)"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return "it holds an integer of more than 4300 digits, which Python's parser refuses"
    if isinstance(cause, UnicodeDecodeError):
        return f"it is not UTF-8 text (byte {cause.start})"
    return "send UTF-8 JSON text"


JSON_TYPES = ("application/json",)


def is_json(content_type: str) -> bool:
    """As FastAPI reads a body as JSON: application/json, or an application/...+json type."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))


async def body_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """A body its request model refuses: a 4xx naming the field (`checks.openai_error`); 415 for a body sent as
    another content type than JSON, or without one (FastAPI hands either over unread)."""
    content_type = request.headers.get("content-type")
    message = None
    if content_type and not is_json(content_type):
        message = f"The request body was sent as Content-Type {content_type!r}: send it as JSON (application/json)."
    elif not content_type and await request.body():
        message = "The request body was sent without a Content-Type header: send it as JSON (application/json)."
    if message is not None:
        logger.warning("Refused (415): %s", message)
        return JSONResponse(error_body(message, 415, None, "unsupported_media_type"), status_code=415)
    model = BODIES.get(GENERATION_PATHS.get(request.url.path, ""))
    descriptions = {name: field.description for name, field in (model.model_fields if model else {}).items()}
    refusal = openai_error(list(error.errors()), {name: text for name, text in descriptions.items() if text})
    logger.warning("Refused (%d): %s", refusal.status, refusal.message)
    return JSONResponse(refusal.body(), status_code=refusal.status)


async def worker_dead(_request: Request, error: CBWorkerDeadError) -> JSONResponse:
    message = f"{error} The server starts a new continuous-batching engine at the next request: send it again."
    return JSONResponse(error_body(message, 503, None, "worker_dead"), status_code=503)


async def unexpected_error(_request: Request, error: Exception) -> JSONResponse:
    message = f"Internal error while serving the request ({type(error).__name__}: {error}); the server log has it."
    return JSONResponse(error_body(message, 500), status_code=500)


class ApiKey:
    """ASGI middleware: every route but a health check needs `Authorization: Bearer <key>` (a 401 otherwise)."""

    def __init__(self, app: Callable, key: str) -> None:
        self.app, self.expected = app, key.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)  # a CORS preflight carries no credentials
            return
        given = next((value for name, value in scope["headers"] if name.lower() == b"authorization"), b"")
        scheme, _, token = given.strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):  # HTTP: any case
            await self.app(scope, receive, send)
            return
        if not given.strip():
            what = "No API key was given"
        elif scheme.lower() != b"bearer":
            what = "The Authorization header does not start with the Bearer scheme"
        elif not token.strip():
            what = "No API key was given after Bearer"
        else:
            what = "The API key given is not this server's"
        message = f"{what}: send it as the header `Authorization: Bearer <key>` (the server's --api-key)."
        answer = JSONResponse(
            error_body(message, 401, None, "invalid_api_key"), 401, headers={"WWW-Authenticate": "Bearer"}
        )
        await answer(scope, receive, send)


BODY_BYTES_PER_CHARACTER = 6  # a character sent as a JSON escape (\u00e9)
BODY_OVERHEAD = 1024**2  # the rest of a request: its fields, roles, tools
UNKNOWN_CONTEXT_BODY_LIMIT = 32 * 1024**2


def default_body_limit(served: ServedModel) -> int:
    """`--max-body-bytes` by default: the body of the longest prompt the model's context can hold (its tokens times
    the characters of the longest one, each character a JSON escape), and 1 MiB for the rest of the request."""
    if served.context_length is None or served.longest_token is None:
        return UNKNOWN_CONTEXT_BODY_LIMIT
    return BODY_OVERHEAD + BODY_BYTES_PER_CHARACTER * served.context_length * served.longest_token


class BodyTooLarge(Exception):
    """What `BodyLimit`'s receive raises once a body passes the limit; answered 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than {limit} bytes")
        self.limit = limit


def too_large_answer(limit: int) -> JSONResponse:
    message = (
        f"The request body is larger than this server takes ({limit} bytes, --max-body-bytes; the default is sized "
        "to the longest prompt the model's context can hold): send less."
    )
    logger.warning("Refused (413): %s", message)
    return JSONResponse(error_body(message, 413, None, "request_too_large"), status_code=413)


class BodyLimit:
    """ASGI middleware: a body above `limit` bytes is a 413, by its declared length before a byte is read (a client
    that sends `Expect: 100-continue` sends none), else once what arrived passes the limit (the rest dropped as it
    comes, `discard_the_rest`)."""

    def __init__(self, app: Callable, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((value for name, value in scope["headers"] if name.lower() == b"content-length"), b"")
        if declared.isdigit() and int(declared) > self.limit:
            await too_large_answer(self.limit)(scope, receive, send)
            return
        received, started = 0, False

        async def bounded() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def sending(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded, sending)
        except BodyTooLarge:
            if not started:
                await discard_the_rest(receive)
                await too_large_answer(self.limit)(scope, receive, send)


LINGER_S = 2  # how long the rest of a refused body is read and dropped


async def discard_the_rest(receive: Callable) -> None:
    """Read and drop what a client still sends of a refused body, for `LINGER_S` at most (as nginx's lingering
    close): a socket closed with unread data is reset, and the client would never read its 413."""
    deadline = time.monotonic() + LINGER_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body"):
            return


class RequestWatch:
    """ASGI middleware: a generation request's `InFlight`, cancelled when its client disconnects."""

    def __init__(self, app: Callable, requests: InFlightRequests) -> None:
        self.app, self.requests = app, requests

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        header = X_REQUEST_ID.encode()
        request_id = next((value.decode() for name, value in scope["headers"] if name.lower() == header), None)
        if request_id is None:  # the id transformers' middleware would make up, made up here to be known here
            request_id = str(uuid.uuid4())
            scope = {**scope, "headers": [*scope["headers"], (header, request_id.encode())]}
        flight = self.requests.open(request_id)
        if flight is None:
            message = f"A request with {X_REQUEST_ID} {request_id!r} is already in flight: give each its own id."
            await JSONResponse(error_body(message, 409, X_REQUEST_ID, "duplicate_request_id"), 409)(
                scope, receive, send
            )
            return
        status = 0

        async def sending(message: dict) -> None:
            nonlocal status
            status = message.get("status", status)
            await send(message)

        try:
            await self.serve(flight, scope, receive, sending)
        finally:  # a body refused midway (BodyLimit) included
            self.requests.close(flight)
            if status >= 400:  # its objects are gone now; what they held goes back to the system, off the loop
                asyncio.get_running_loop().run_in_executor(None, give_back_freed_memory)

    async def serve(self, flight: InFlight, scope: dict, receive: Callable, send: Callable) -> None:
        # The body is read here, so that whatever this middleware receives next is the disconnect.
        received: list[dict] = []
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        gone = asyncio.Event()

        async def replay() -> dict:
            if received:
                return received.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            flight.cancel(DISCONNECT)

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                flight.finished = True  # uvicorn reports a finished response as a disconnect
            await send(message)

        reset = CURRENT_FLIGHT.set(flight)
        watcher = asyncio.ensure_future(watch())
        try:
            await self.app(scope, replay, sending)
        finally:
            watcher.cancel()
            CURRENT_FLIGHT.reset(reset)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, cancelling the requests in flight as it starts shutting down."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], Any]) -> None:
        super().__init__(config)
        self.on_shutdown = on_shutdown

    async def shutdown(self, sockets: list | None = None) -> None:
        cancelled = self.on_shutdown()
        if cancelled:
            logger.warning("Shutting down: %s request(s) in flight cancelled.", cancelled)
        await super().shutdown(sockets=sockets)
