"""The routes of transformers' app as this server declares them, and the doors it closes.

transformers' `build_server` declares each generation route's body as `dict`, so `/openapi.json` says "any object"
and nothing is checked before its handler reads the body. Here those routes are replaced by routes of the same
paths that take the request models of `bodies` (FastAPI publishes them and validates every body against them) and
answer in the `openai` package's own response models; `/v1/models` answers in openai's model object. The routes
for work a served text model cannot do (`/v1/audio/transcriptions`, `/v1/systemone`) are removed (404), and so are
the administration routes (`/reset` drops the served model for every client, `/load_model` loads any path the
process can read) unless `--enable-admin-routes` keeps them; the server is pinned to its model, and `/load_model`
refuses any other.
"""

from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from pydantic import BaseModel

from .bodies import BODIES
from .checks import MAX_TOKEN_FIELDS, RequestError
from .fields import NonEmpty, Strict


GENERATION_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "response"}
ADMIN_PATHS = ("/load_model", "/reset")
UNSERVED_PATHS = ("/v1/audio/transcriptions", "/v1/systemone")
ANSWERS = {"chat": ChatCompletion, "completion": Completion, "response": Response}
SUMMARIES = {
    "chat": "A chat completion (OpenAI's Chat Completions API)",
    "completion": "A text completion of one prompt (OpenAI's legacy Completions API)",
    "response": "A response (OpenAI's Responses API); streams only when asked, as OpenAI's does",
}


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape."""

    error: ErrorObject


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class LoadModelRequest(Strict):
    model: NonEmpty


ERRORS = {
    status: {"model": ErrorResponse, "description": words}
    for status, words in {
        400: "a field the server cannot honour, named in `param`",
        401: "no API key, or another one (with --api-key)",
        404: "another model than the served one",
        409: "a request id already in flight",
        413: "a body larger than the server takes (--max-body-bytes)",
        415: "a body sent as another content type than JSON",
        422: "a body that is not a JSON object of the endpoint's fields",
        503: "the server is shutting down, or its continuous-batching worker died",
    }.items()
}


# One server-sent event: its `data` a JSON chunk of the answer (OpenAI's), or `[DONE]` where OpenAI's streams end so.
EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
    "description": "a server-sent event: a chunk of the answer as JSON in `data`, or [DONE]",
}


def generation_route(handler: Any, body_model: type) -> Callable:
    """The route of one generation endpoint: its body as the request model, served by transformers' handler."""

    async def route(request: Request, body: body_model) -> Any:  # type: ignore[valid-type]
        return await handler.handle_checked(body, request.state.request_id)

    return route


def declare_routes(app: FastAPI, handlers: dict[str, Any], model_manager: Any, admin_routes: bool) -> None:
    """Replace transformers' generation and model-list routes by declared ones; close the doors not asked for."""
    dropped = set(GENERATION_PATHS) | set(UNSERVED_PATHS) | {"/v1/models", "/load_model"}
    if not admin_routes:
        dropped |= set(ADMIN_PATHS)
    kept = [route for route in app.router.routes if getattr(route, "path", None) not in dropped]
    load_model = next((route for route in app.router.routes if getattr(route, "path", None) == "/load_model"), None)
    app.router.routes[:] = kept
    for path, endpoint in GENERATION_PATHS.items():
        stream = {"text/event-stream": {"schema": EVENT}}
        app.add_api_route(
            path,
            generation_route(handlers[endpoint], BODIES[endpoint]),
            methods=["POST"],
            summary=SUMMARIES[endpoint],
            response_model=None,
            responses={200: {"model": ANSWERS[endpoint], "content": stream}, **ERRORS},
        )

    def list_models() -> dict[str, Any]:
        return {"object": "list", "data": model_manager.get_gen_models()}

    app.add_api_route(
        "/v1/models", list_models, methods=["GET"], response_model=ModelList, summary="The served model", responses={
            401: ERRORS[401]}
    )  # fmt: skip
    if admin_routes and load_model is not None:
        app.add_api_route(
            "/load_model",
            pinned_loader(load_model.endpoint, model_manager),
            methods=["POST"],
            response_model=None,
            summary="Load the served model again (--enable-admin-routes); the server is pinned to it",
            responses={200: {"content": {"text/event-stream": {"schema": EVENT}}}, **ERRORS},
        )
    app.openapi_schema = None  # built again from these routes
    app.openapi = served_schema(app.openapi, model_manager)


def served_schema(build: Callable[[], dict], model_manager: Any) -> Callable[[], dict]:
    """FastAPI's schema with what only the served model knows: its name, and its context as the most tokens a
    completion may ask for."""
    done: list[dict] = []

    def openapi() -> dict:
        if done:
            return done[0]
        schema = build()
        served = model_manager.served
        for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest"):
            properties = schema["components"]["schemas"][name]["properties"]
            words = "the served model's name (as /v1/models lists it), or left out"
            properties["model"] = {"anyOf": [{"enum": [served.name]}, {"type": "null"}], "description": words}
            for field in MAX_TOKEN_FIELDS:
                if field in properties and served.context_length:
                    properties[field]["anyOf"][0]["maximum"] = served.context_length
        done.append(schema)
        return schema

    return openapi


def pinned_loader(load: Callable, model_manager: Any) -> Callable:
    """transformers' `/load_model`, for the served model only."""

    async def load_model(body: LoadModelRequest) -> Any:
        served = model_manager.served.name
        if body.model != served:
            raise RequestError(
                f"This server is pinned to `{served}`: it loads no other model (start a server for `{body.model}`).",
                "model",
                "model_not_found",
                404,
            )
        return await load({"model": model_manager.force_model})

    return load_model
