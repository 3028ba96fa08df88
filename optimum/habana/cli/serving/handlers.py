"""transformers' chat, completion and responses handlers, each checking its request before handling it.

Each handler here is transformers' own with three additions: the body is checked (`validation`) before the
handler reads it, with the asked completion length handed to the generation managers (`generation`); the answer
names the model as the client named it (transformers answers `<name>@main`); and a chat or completion stream ends
with `data: [DONE]` as OpenAI's do, its error events in OpenAI's error shape. Responses streams end with
`response.completed` (or `response.failed`), as OpenAI's do, without `[DONE]`.
"""

import json
from collections.abc import AsyncIterator
from typing import Any

from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.response import ResponseHandler

from .generation import CURRENT_TOKENS, SHUTDOWN_MESSAGE
from .validation import RequestError, ServedModel, check_request, error_body


DONE = "data: [DONE]\n\n"


class CheckedHandler:
    """The checks, placed before a transformers handler in the method order."""

    endpoint = ""  # a key of validation.CHECKS
    uses_chat_template = True

    async def handle_request(self, body: dict, request_id: str) -> Any:
        from fastapi.responses import StreamingResponse
        from jinja2 import TemplateError

        self._validate_request(body)  # transformers' own: an unknown field is a 422 naming it
        served: ServedModel = self.model_manager.served
        if self.uses_chat_template and not self.model_manager.has_chat_template:
            raise RequestError(
                f"`{served.name}` has no chat template, so it cannot take messages: send the text to /v1/completions.",
                None,
                "unsupported_endpoint",
            )
        reset = CURRENT_TOKENS.set(check_request(self.endpoint, body, served))
        try:
            response = await super().handle_request(body, request_id)
        except TemplateError as error:  # the template's own check of the conversation (roles' order, ...)
            raise RequestError(f"The model's chat template refused the messages: {error}", "messages") from None
        finally:
            CURRENT_TOKENS.reset(reset)
        if isinstance(response, StreamingResponse) and self.endpoint != "response":
            response.body_iterator = finish_stream(response.body_iterator)
        return response

    def _resolve_model(self, body: dict) -> tuple[str, Any, Any]:
        _, model, processor = super()._resolve_model(body)
        return self.model_manager.served.name, model, processor


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
