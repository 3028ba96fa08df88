"""Every request body checked before transformers' handlers see it: a bad field is a 4xx in OpenAI's error shape
that names the field and what it accepts, never a 500 from deep inside generation.

transformers' handlers read the body with `int()`, `float()` and `dict` lookups, so a `max_tokens` of "abc", a
`stop` of 5 or a `prompt` that is missing end as tracebacks; values out of range (`temperature` -1, `top_p` 2.5)
and fields it does not implement (`n` 3, `logprobs`) pass silently. Here each field the server honours is checked
against the range OpenAI documents (narrowed where transformers' mapping needs it), each field that would change
the answer and that it does not honour is refused when set, and fields that only label a request (`user`,
`metadata`, `store`, ...) are accepted and ignored, as docs/serving.md lists.
"""

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class RequestError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error object (message, type, param, code)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = "invalid_value", status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.code)


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, which its clients parse."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the pinned model's name, context length and vocabulary, and whether
    continuous batching serves it."""

    name: str
    context_length: int | None
    vocab_size: int | None
    continuous_batching: bool = False


@dataclass(frozen=True)
class TokenRequest:
    """The completion length a request asked for (None: as much as the context leaves), the field that said it, and
    how its prompt is named in messages ("messages", "prompt", "input")."""

    max_tokens: int | None
    param: str
    prompt: str


ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields that change the answer and are not implemented: refused unless left out or set to one of these.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "presence_penalty": (0,),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "tool_choice": ("auto", "none"),
    "truncation": ("disabled",),
    "background": (False,),
}
# Fields that change the answer and are not implemented in any value.
REFUSED = (
    "audio", "prediction", "web_search_options", "functions", "function_call", "reasoning_effort", "reasoning",
    "previous_response_id", "conversation",
)  # fmt: skip
UNSUPPORTED_HINTS = {
    "n": "this server returns one choice per request: send n requests instead",
    "best_of": "this server returns one choice per request",
    "functions": "use `tools`",
    "function_call": "use `tools`",
    "reasoning_effort": 'use `chat_template_kwargs` (e.g. {"enable_thinking": true}) where the model\'s template has it',
    "reasoning": "use the server's --reasoning option or `generation_config`",
    "previous_response_id": "this server stores no responses: send the whole conversation in `input`",
    "conversation": "this server stores no conversations: send the whole conversation in `input`",
    "tool_choice": 'the model chooses by itself ("auto"), or "none" to offer it no tools',
}
# OpenAI's ranges, narrowed where transformers needs it.
RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "frequency_penalty": (-1.0, 2.0)}
OPEN_LOWER = {"top_p", "frequency_penalty"}  # top_p 0 keeps no token; frequency_penalty -1 is a repetition penalty 0
SEED_RANGE = (-(2**63), 2**64 - 1)  # torch.manual_seed's
# What transformers' continuous batching does not apply per request (its engine takes only the prompt, max_new_tokens
# and the end-of-sequence ids): refused there unless left out or neutral, instead of dropped.
NOT_BATCHED = {"stop": (), "logit_bias": ({},), "frequency_penalty": (0,)}


def kind_of(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def integer(body: Mapping[str, Any], name: str, minimum: int | None = None, label: str | None = None) -> int | None:
    """The field as an int (None when absent or null); floats such as 1e6 are refused, as OpenAI does."""
    value, label = body.get(name), label or name
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"`{label}` must be an integer, got {json.dumps(value)}.", label, "invalid_type")
    if minimum is not None and value < minimum:
        raise RequestError(f"`{label}` must be at least {minimum}, got {value}.", label)
    return value


def number(body: Mapping[str, Any], name: str, label: str | None = None) -> float | None:
    """The field as a finite float within RANGES[name] (None when absent or null)."""
    value, label = body.get(name), label or name
    if value is None:
        return None
    low, high = RANGES[name]
    interval = f"{'above' if name in OPEN_LOWER else 'from'} {low:g} {'up ' if name in OPEN_LOWER else ''}to {high:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"`{label}` must be a number {interval}, got {json.dumps(value)}.", label, "invalid_type")
    below = value <= low if name in OPEN_LOWER else value < low
    if not math.isfinite(value) or below or value > high:
        raise RequestError(f"`{label}` must be a number {interval}, got {value}.", label)
    return float(value)


def of_type(body: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) and bool not in _tuple(kinds) or not isinstance(value, kinds)):
        raise RequestError(f"`{name}` must be {what}, got {kind_of(value)}.", name, "invalid_type")
    return value


def _tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def check_model(body: dict[str, Any], served: ServedModel) -> None:
    """`model`, when given, must be the served model's name (checked first: another model's request is not read)."""
    model = of_type(body, "model", str, "a string, the served model's name")
    if model is not None and model != served.name:
        raise RequestError(
            f"The model `{model}` does not exist on this server: it is pinned to `{served.name}`. Send that name or "
            "leave `model` out.",
            "model",
            "model_not_found",
            404,
        )


def check_common(body: dict[str, Any], served: ServedModel) -> None:
    """The fields every generation endpoint shares: stream, sampling, seed, generation_config, the refused ones."""
    of_type(body, "stream", bool, "a boolean")
    number(body, "temperature")
    number(body, "top_p")
    seed = integer(body, "seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise RequestError(f"`seed` must be a 64-bit integer, got {seed}.", "seed")
    for name, allowed in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(same(value, choice) for choice in allowed):
            hint = UNSUPPORTED_HINTS.get(name, "leave it out")
            shown = " or ".join(json.dumps(choice) for choice in allowed)
            raise RequestError(
                f"`{name}` {json.dumps(value)} is not supported by this server ({hint}); it accepts only {shown}.",
                name,
                "unsupported_value",
            )
    for name in REFUSED:
        if body.get(name) is not None:
            hint = UNSUPPORTED_HINTS.get(name, "leave it out")
            raise RequestError(f"`{name}` is not supported by this server: {hint}.", name, "unsupported_parameter")
    check_generation_config(body)
    of_type(body, "chat_template_kwargs", dict, "an object")


def same(value: Any, choice: Any) -> bool:
    """JSON equality, where true is not 1."""
    return isinstance(value, bool) == isinstance(choice, bool) and value == choice


def check_generation_config(body: dict[str, Any]) -> None:
    """transformers' own extension: a JSON string of GenerationConfig arguments, checked as the fields are."""
    text = of_type(body, "generation_config", str, "a string holding a JSON object of GenerationConfig arguments")
    if text is None:
        return
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise RequestError(f"`generation_config` is not JSON: {error}.", "generation_config") from None
    if not isinstance(config, dict):
        raise RequestError("`generation_config` must hold a JSON object.", "generation_config", "invalid_type")
    for name in ("temperature", "top_p"):
        number(config, name, label=f"generation_config.{name}")
    integer(config, "max_new_tokens", 1, label="generation_config.max_new_tokens")
    integer(config, "top_k", 0, label="generation_config.top_k")
    integer(config, "num_beams", 1, label="generation_config.num_beams")
    if config.get("num_return_sequences", 1) != 1:
        raise RequestError(
            "`generation_config.num_return_sequences` must be 1: this server returns one choice per request.",
            "generation_config.num_return_sequences",
            "unsupported_value",
        )
    if config.get("max_length") is not None:
        raise RequestError(
            "`generation_config.max_length` is not supported: set `max_new_tokens` (or the request's `max_tokens`).",
            "generation_config.max_length",
            "unsupported_parameter",
        )
    from transformers import GenerationConfig

    try:
        GenerationConfig(**config)
    except (TypeError, ValueError) as error:
        raise RequestError(f"`generation_config` is not valid: {error}", "generation_config") from None


def requested_tokens(body: dict[str, Any], names: tuple[str, ...], prompt: str) -> TokenRequest:
    """The completion length asked for, by the first of `names` set (else the generation_config's)."""
    values = {name: integer(body, name, 1) for name in names}
    for name, value in values.items():
        if value is not None:
            return TokenRequest(value, name, prompt)
    config = json.loads(body["generation_config"]) if body.get("generation_config") else {}
    return TokenRequest(config.get("max_new_tokens"), "generation_config.max_new_tokens", prompt)


def check_stop(body: dict[str, Any]) -> None:
    stop = body.get("stop")
    if stop is None or isinstance(stop, str) and stop:
        return
    if not isinstance(stop, list) or not 1 <= len(stop) <= 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(
            f"`stop` must be a non-empty string or an array of 1 to 4 non-empty strings, got {json.dumps(stop)}.",
            "stop",
            "invalid_type" if not isinstance(stop, (str, list)) else "invalid_value",
        )


def check_penalties(body: dict[str, Any], served: ServedModel, logit_bias: bool = True) -> None:
    number(body, "frequency_penalty")
    bias = of_type(body, "logit_bias", dict, "an object of token ids and biases from -100 to 100")
    if not bias:
        return
    if not logit_bias:
        raise RequestError("`logit_bias` is not supported on this endpoint.", "logit_bias", "unsupported_parameter")
    for token, value in bias.items():
        top = served.vocab_size
        if not token.isdigit() or top is not None and int(token) >= top:
            within = f" from 0 to {top - 1}" if top is not None else ""
            raise RequestError(f"`logit_bias` key {token!r} is not a token id{within}.", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise RequestError(
                f"`logit_bias` values must be numbers from -100 to 100, got {value} for token {token}.", "logit_bias"
            )
    body["logit_bias"] = {token: float(value) for token, value in bias.items()}  # transformers needs floats


def check_tools(body: dict[str, Any], flat: bool = False) -> None:
    tools = of_type(body, "tools", list, "an array of function tools")
    for index, tool in enumerate(tools or []):
        function = tool.get("function", tool if flat else None) if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(f"`tools[{index}]` must be a function tool.", f"tools[{index}]", "unsupported_value")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"`tools[{index}]` needs a function `name`.", f"tools[{index}]")
    if body.get("tool_choice") == "none":
        body.pop("tools", None)  # OpenAI's "none": the model is offered no tool


def check_content(content: Any, where: str, parts: tuple[str, ...], required: bool) -> None:
    """A message's content: a string or an array of text parts (this server's models read text only)."""
    if content is None:
        if required:
            raise RequestError(f"`{where}` is missing: give the message's text.", where, "missing_required_parameter")
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RequestError(f"`{where}` must be a string or an array of content parts.", where, "invalid_type")
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in parts:
            raise RequestError(
                f"`{where}[{index}]` is {json.dumps(kind) if kind else 'not a content part'}: this model reads text "
                f"only, in parts of type {' or '.join(json.dumps(p) for p in parts)}.",
                f"{where}[{index}]",
                "unsupported_value",
            )
        if not isinstance(part.get("text"), str):
            raise RequestError(f"`{where}[{index}].text` must be a string.", f"{where}[{index}].text", "invalid_type")


def check_message(message: Any, where: str, parts: tuple[str, ...]) -> None:
    if not isinstance(message, dict):
        raise RequestError(f"`{where}` must be an object with `role` and `content`.", where, "invalid_type")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(
            f"`{where}.role` {json.dumps(role)} is not a role: take one of {', '.join(ROLES)}.", f"{where}.role"
        )
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise RequestError(
                f"`{where}.tool_calls` must be an array on an assistant message.", f"{where}.tool_calls"
            )
        for index, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError(f"`{where}.tool_calls[{index}]` needs a `function` with a `name`.", where)
            if isinstance(arguments, str):
                try:
                    json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            if not isinstance(arguments, (str, dict)):
                raise RequestError(
                    f"`{where}.tool_calls[{index}].function.arguments` must be a JSON object (or its JSON text).",
                    f"{where}.tool_calls[{index}].function.arguments",
                )
    check_content(message.get("content"), f"{where}.content", parts, required=calls is None and role != "assistant")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise RequestError(f"`{where}.tool_call_id` must name the tool call answered.", f"{where}.tool_call_id")


def check_chat_completion(body: dict[str, Any], served: ServedModel) -> TokenRequest:
    """`/v1/chat/completions`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        missing = "messages" not in body
        raise RequestError(
            "`messages` is missing: send an array of at least one message." if missing else
            f"`messages` must be a non-empty array of messages, got {json.dumps(messages)[:60]}.",
            "messages",
            "missing_required_parameter" if missing else "invalid_value" if messages == [] else "invalid_type",
        )  # fmt: skip
    for index, message in enumerate(messages):
        check_message(message, f"messages[{index}]", ("text",))
    check_common(body, served)
    check_stop(body)
    check_penalties(body, served)
    check_tools(body)
    return requested_tokens(body, ("max_completion_tokens", "max_tokens"), "messages")


def check_completion(body: dict[str, Any], served: ServedModel) -> TokenRequest:
    """`/v1/completions`: one prompt string."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(
            "`prompt` is missing: send the text to continue." if prompt is None else
            "`prompt` is empty: send the text to continue." if prompt == "" else
            "`prompt` must be one string here (lists of prompts and token ids are not supported).",
            "prompt",
            "missing_required_parameter" if prompt is None else "invalid_value" if prompt == "" else "invalid_type",
        )  # fmt: skip
    of_type(body, "suffix", str, "a string")
    check_common(body, served)
    check_stop(body)
    check_penalties(body, served, logit_bias=False)
    return requested_tokens(body, ("max_tokens",), "prompt")


RESPONSE_PARTS = ("input_text", "output_text", "text")
# The fields of the Responses API's input items that transformers reads, by item type.
ITEM_FIELDS = {"function_call": ("call_id", "name", "arguments"), "function_call_output": ("call_id", "output")}


def check_input_item(item: Any, where: str) -> None:
    """One item of a Responses `input` array: a message, a function call or its output, or reasoning."""
    kind = item.get("type") if isinstance(item, dict) else None
    if isinstance(item, dict) and "role" in item:
        check_message(item, where, RESPONSE_PARTS)
    elif kind in ITEM_FIELDS:
        for name in ITEM_FIELDS[kind]:
            if not isinstance(item.get(name), str):
                raise RequestError(f"`{where}.{name}` must be a string ({kind} item).", f"{where}.{name}")
    elif kind != "reasoning":
        raise RequestError(
            f"`{where}` is not an input item: give a message (with `role`), a function_call, a "
            "function_call_output or a reasoning item.",
            where,
        )


def check_response(body: dict[str, Any], served: ServedModel) -> TokenRequest:
    """`/v1/responses`: `input` a string or an array of items; OpenAI's default of no streaming."""
    value = body.get("input")
    if not value or not isinstance(value, (str, list)):
        raise RequestError(
            "`input` is missing: send a string or an array of input items." if value is None else
            f"`input` must be a non-empty string or array of input items, got {json.dumps(value)[:60]}.",
            "input",
            "missing_required_parameter" if value is None else "invalid_value",
        )  # fmt: skip
    if isinstance(value, list) and not (isinstance(value[0], dict) and "role" in value[0]):
        check_content(value, "input", RESPONSE_PARTS, required=True)  # transformers' reading: one user message
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_input_item(item, f"input[{index}]")
    of_type(body, "instructions", str, "a string")
    text_format = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and (text_format or {"type": "text"}).get("type") != "text":
        raise RequestError(
            f"`text` {json.dumps(body['text'])} is not supported by this server: it answers in plain text only.",
            "text",
            "unsupported_value",
        )
    if body.get("prompt") is not None:
        raise RequestError(
            "`prompt` (a stored prompt template) is not supported by this server: send the text in `input`.",
            "prompt",
            "unsupported_parameter",
        )
    body.setdefault("stream", False)  # OpenAI's default; transformers' handler streams unless told not to
    check_common(body, served)
    check_tools(body, flat=True)
    return requested_tokens(body, ("max_output_tokens",), "input")


CHECKS: dict[str, Callable[[dict[str, Any], ServedModel], TokenRequest]] = {
    "chat": check_chat_completion,
    "completion": check_completion,
    "response": check_response,
}


def check_request(endpoint: str, body: dict[str, Any], served: ServedModel) -> TokenRequest:
    """The request of `endpoint` ("chat", "completion" or "response"), checked; what it asks for."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object of the endpoint's fields.", None, "invalid_type")
    check_model(body, served)
    request = CHECKS[endpoint](body, served)
    if served.continuous_batching:
        for name, neutral in NOT_BATCHED.items():
            value = body.get(name)
            if value is not None and not any(same(value, choice) for choice in neutral):
                raise RequestError(
                    f"`{name}` is not applied by continuous batching, which this server runs: leave it out, or serve "
                    "without --continuous-batching.",
                    name,
                    "unsupported_parameter",
                )
    return request
