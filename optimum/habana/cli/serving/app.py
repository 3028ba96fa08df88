"""What GaudiServe adds to the app transformers' `build_server` returns, and the uvicorn server that runs it.

- Errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`): the request models' validation
  errors and the checks' `RequestError`s (`checks`), the HTTP errors transformers and FastAPI raise (404, ...), a
  dead continuous-batching worker (503), and anything unexpected (500, its traceback in the log).
- `ApiKey`, an ASGI middleware that, with `--api-key`, answers 401 to every request but `/health` that does not
  carry `Authorization: Bearer <key>` (compared in constant time).
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
from .checks import RequestError, error_body, openai_error
from .generation import CURRENT_FLIGHT, DISCONNECT, InFlightRequests
from .routes import GENERATION_PATHS


logger = logging.getLogger(__name__)


OPEN_PATHS = frozenset({"/health"})  # what answers without the API key
SHUTDOWN_GRACE_S = 5  # after in-flight requests were cancelled, what uvicorn waits for before cancelling its tasks


def install(app: FastAPI, requests: InFlightRequests, api_key: str | None = None) -> None:
    """The error handlers, the request watch and the key, on this app only (transformers' other apps are untouched)."""
    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, body_error)
    app.add_exception_handler(CBWorkerDeadError, worker_dead)
    app.add_exception_handler(Exception, unexpected_error)
    app.add_middleware(RequestWatch, requests=requests)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)  # the outermost: nothing runs for a request without the key


async def request_error(_request: Request, error: RequestError) -> JSONResponse:
    if error.status < 499:
        logger.warning("Refused (%d): %s", error.status, error.message)
    return JSONResponse(error.body(), status_code=error.status)


async def http_error(request: Request, error: HTTPException) -> JSONResponse:
    detail = error.detail if isinstance(error.detail, str) else str(error.detail)
    if error.status_code == 400 and detail == "There was an error parsing the body":  # FastAPI's words
        detail = "The request body could not be read as JSON: send UTF-8 JSON text."
    if error.status_code == 404 and detail == "Not Found":
        detail = (
            f"{request.url.path} is not served here: this server serves a text model at /v1/chat/completions, "
            "/v1/completions, /v1/responses and /v1/models (/reset and /load_model need --enable-admin-routes)."
        )
    return JSONResponse(error_body(detail, error.status_code), status_code=error.status_code, headers=error.headers)


async def body_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """A body its request model refuses: a 4xx naming the field (`checks.openai_error`)."""
    model = BODIES.get(GENERATION_PATHS.get(request.url.path, ""))
    descriptions = {name: field.description for name, field in (model.model_fields if model else {}).items()}
    refusal = openai_error(list(error.errors()), {name: text for name, text in descriptions.items() if text})
    logger.warning("Refused (%d): %s", refusal.status, refusal.message)
    return JSONResponse(refusal.body(), status_code=refusal.status)


async def worker_dead(_request: Request, error: CBWorkerDeadError) -> JSONResponse:
    message = f"{error} The server starts a new continuous-batching worker at the next request: send it again."
    return JSONResponse(error_body(message, 503, None, "worker_dead"), status_code=503)


async def unexpected_error(_request: Request, error: Exception) -> JSONResponse:
    message = f"Internal error while serving the request ({type(error).__name__}: {error}); the server log has it."
    return JSONResponse(error_body(message, 500), status_code=500)


class ApiKey:
    """ASGI middleware: every route but a health check needs `Authorization: Bearer <key>` (a 401 otherwise)."""

    def __init__(self, app: Callable, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)  # a CORS preflight carries no credentials
            return
        given = next((value for name, value in scope["headers"] if name.lower() == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        what = "No API key was given" if not given else "The API key given is not this server's"
        message = f"{what}: send it as the header `Authorization: Bearer <key>` (the server's --api-key)."
        answer = JSONResponse(
            error_body(message, 401, None, "invalid_api_key"), 401, headers={"WWW-Authenticate": "Bearer"}
        )
        await answer(scope, receive, send)


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
            self.requests.close(flight)


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
