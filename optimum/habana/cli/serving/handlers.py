"""transformers' chat, completion and responses handlers, each taking a request its model has checked.

Each handler here is transformers' own with these additions: the request arrives validated (`bodies`: the route
declares it) and is checked against the served model (`checks`, and its prompt's length: `preparation`), with the
asked completion length handed to the generation managers (`generation`); transformers' handler then runs off the
event loop (`preparation`); its generation settings are the model's generation config (with the server's
flags) updated by the request's `generation_config` and sampling fields, checked before generation (transformers
replaces the model's config by the request's, end-of-sequence ids included); a `temperature` above 0 samples, as
OpenAI's does; the answer names the model as the client named it (transformers answers `<name>@main`); a chat or
completion stream ends with `data: [DONE]` as OpenAI's do, its error events in OpenAI's error shape. Responses
streams end with `response.completed` (or `response.failed`), as OpenAI's do, without `[DONE]`.
"""

import contextvars
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.response import ResponseHandler

from .checks import RequestError, ServedModel, check_generation, check_request, error_body
from .fields import SAMPLING_EPS
from .generation import CURRENT_FLIGHT, CURRENT_TOKENS, SHUTDOWN_MESSAGE, cancellation_error, shared_generation_config
from .preparation import check_prompt_length, off_the_loop


DONE = "data: [DONE]\n\n"
CURRENT_REQUEST: contextvars.ContextVar[Any] = contextvars.ContextVar("gaudi_serve_request", default=None)


class CheckedHandler:
    """Placed before a transformers handler in the method order: the checks and the generation settings."""

    endpoint = ""  # a key of bodies.BODIES
    uses_chat_template = True

    def _validate_request(self, body: dict) -> None:
        """The request model checked every field (transformers' check would refuse the fields it accepts)."""

    async def handle_checked(self, request: Any, request_id: str) -> Any:
        """Serve a validated request (a model of `bodies`)."""
        from fastapi.responses import StreamingResponse
        from jinja2 import TemplateError

        served: ServedModel = self.model_manager.served
        if self.uses_chat_template and not self.model_manager.has_chat_template:
            raise RequestError(
                f"`{served.name}` has no chat template, so it cannot take messages: send the text to /v1/completions.",
                None,
                "unsupported_endpoint",
            )
        asked = check_request(request, served)
        check_prompt_length(request, served)
        tokens = CURRENT_TOKENS.set(asked)
        current = CURRENT_REQUEST.set(request)

        async def handle() -> Any:  # in a worker thread: templating, tokenizing, the generation settings
            return await self.handle_request(request.for_transformers(), request_id)

        try:
            response = await off_the_loop(handle())
        except TemplateError as error:  # the template's own check of the conversation (roles' order, ...)
            raise RequestError(f"The model's chat template refused the messages: {error}", "messages") from None
        except Exception:
            flight = CURRENT_FLIGHT.get()
            if flight is not None and flight.cancelled:  # shut down under it (the model unloaded...): say so
                raise cancellation_error(flight.reason) from None
            raise
        finally:
            CURRENT_REQUEST.reset(current)
            CURRENT_TOKENS.reset(tokens)
        if isinstance(response, StreamingResponse) and self.endpoint != "response":
            response.body_iterator = finish_stream(response.body_iterator)
        return response

    def _resolve_model(self, body: dict) -> tuple[str, Any, Any]:
        _, model, processor = super()._resolve_model(body)
        return self.model_manager.served.name, model, processor

    def _build_generation_config(self, body: dict, model_generation_config: Any, use_cb: bool = False) -> Any:
        request = CURRENT_REQUEST.get()
        options = request.generation_config.model_dump(exclude_none=True) if request.generation_config else {}
        base = copy.deepcopy(model_generation_config)
        for name, value in options.items():
            setattr(base, name, value)
        config = super()._build_generation_config(body, base, use_cb=use_cb)
        if request.temperature is not None and "do_sample" not in options:
            config.do_sample = request.temperature >= SAMPLING_EPS  # OpenAI's meaning: above 0 samples
        engine = shared_generation_config(model_generation_config) if use_cb else None
        check_generation(config, request, engine)
        return config


class GaudiChatCompletionHandler(CheckedHandler, ChatCompletionHandler):
    """`/v1/chat/completions`, checked."""

    endpoint = "chat"


class GaudiCompletionHandler(CheckedHandler, CompletionHandler):
    """`/v1/completions`, checked."""

    endpoint = "completion"
    uses_chat_template = False


class GaudiResponseHandler(CheckedHandler, ResponseHandler):
    """`/v1/responses`, checked."""

    endpoint = "response"

    @staticmethod
    def _normalize_input(body: dict) -> list[dict]:
        """transformers' reading of `input`, except that an array is always items: transformers read an array whose
        first item has no `role` (a function_call) as text parts, and failed on the messages after it (a KeyError).
        `bodies` hands text parts over as one user message."""
        if not isinstance(body["input"], list):
            return ResponseHandler._normalize_input(body)
        messages = ResponseHandler._normalize_response_items(body["input"])
        instructions = body.get("instructions")
        if instructions and messages and messages[0]["role"] == "system":
            messages[0]["content"] = instructions
        elif instructions:
            messages.insert(0, {"role": "system", "content": instructions})
        return messages


async def finish_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The handler's events with OpenAI's error shape, then `data: [DONE]`."""
    try:
        async for chunk in chunks:
            yield openai_errors(chunk)
        yield DONE
    finally:
        await chunks.aclose()


def openai_errors(chunk: str) -> str:
    """transformers' stream errors (`data: {"error": "<text>"}`) as OpenAI's `{"error": {"message", ...}}`."""
    if '"error"' not in chunk:
        return chunk
    events = []
    for event in chunk.split("\n\n"):
        prefix = 'data: {"error": "'
        if event.startswith(prefix) and event.endswith('"}'):
            try:
                message = json.loads(event[len("data: ") :])["error"]
            except (json.JSONDecodeError, TypeError, KeyError):
                message = event[len(prefix) : -2]  # transformers writes the text unescaped
            if isinstance(message, str):
                code = "server_shutting_down" if message == SHUTDOWN_MESSAGE else None
                event = f"data: {json.dumps(error_body(message, 503 if code else 500, None, code))}"
        events.append(event)
    return "\n\n".join(events)
