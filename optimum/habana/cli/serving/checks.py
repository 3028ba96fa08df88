"""What the request models cannot say alone, and every refusal in OpenAI's error shape.

The models (`bodies`, `fields`) check each field's type and range. Here: their validation errors as a 4xx naming
the field (`openai_error`), and the checks across fields and against the served model: its name (404), its
vocabulary (`logit_bias`), what continuous batching applies per request, and the generation settings a request
asks for (GenerationConfig's own ranges, the attention flags' combination, what the batch shares).
"""

import json
from dataclasses import dataclass
from typing import Any

from optimum.habana.transformers.attention_flags import ATTENTION_FLAG_NAMES, check_flag_combination

from .fields import SAMPLING_EPS


class RequestError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error object (message, type, param, code)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = "invalid_value", status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = safe(message), param and safe(param), code, status

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.code)


def safe(text: str) -> str:
    """Text a JSON answer can carry: a client's lone surrogate echoed back as an escape, not an encoding error."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, which its clients parse."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the pinned model's name, context length and vocabulary, whether
    continuous batching serves it, and the most characters one token of its vocabulary stands for."""

    name: str
    context_length: int | None
    vocab_size: int | None
    continuous_batching: bool = False
    longest_token: int | None = None


@dataclass(frozen=True)
class TokenRequest:
    """The completion length a request asked for (None: as much as the context leaves), the field that said it, and
    how its prompt is named in messages ("messages", "prompt", "input")."""

    max_tokens: int | None
    param: str
    prompt: str


# ---------------------------------------------------------------------------------------------------------------
# Validation errors of the request models, as OpenAI's errors

OWN_ERRORS = {"invalid_value", "unsupported_value", "unsupported_parameter", "missing_required_parameter"}
# Parts of pydantic's error locations that name a union member, not a field.
# (bodies' input items, then a chat message's roles)
UNION_TAGS = {"message", "function_call", "function_call_output", "reasoning", "input_text", "str", "int", "float"}
UNION_TAGS |= {"system", "developer", "user", "assistant", "tool"}
FREE_FORM = {"logit_bias", "metadata", "chat_template_kwargs", "parameters", "schema", "json_schema", "summary"}


def param_of(location: tuple) -> str | None:
    """`messages[0].content` of pydantic's ("body", "messages", 0, "list[...]", ...): fields and indexes only."""
    param = ""
    for index, part in enumerate(location[1:] if location[:1] == ("body",) else location):
        if isinstance(part, int):
            param += f"[{part}]"
            continue
        tag = "[" in part or part[:1].isupper() or part in UNION_TAGS and index > 0
        if not tag:
            param += f".{part}" if param else part
        if part in FREE_FORM:
            break  # what follows are the object's own keys
    return param or None


def shown(value: Any) -> str:
    try:
        text = json.dumps(value, default=str)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 60 else f"{text[:57]}..."


def field_of(problem: dict[str, Any]) -> Any:
    location = tuple(problem.get("loc", ()))
    return location[1:2] if location[:1] == ("body",) else location[:1]


def specificity(problem: dict[str, Any]) -> tuple[int, bool]:
    return len(problem.get("loc", ())), not str(problem.get("type", "")).endswith("_type")


def openai_error(problems: list[dict[str, Any]], descriptions: dict[str, str] | None = None) -> RequestError:
    """The first field's most specific problem as a 4xx: 422 for a body that is not a JSON object or has a field the
    endpoint does not know (as transformers answers), 400 naming the field for everything else."""
    if not problems:
        return RequestError("The request is not valid.", None, "invalid_request_body", 422)
    field = field_of(problems[0])
    same_field = [problem for problem in problems if field_of(problem) == field]
    problem = max(same_field, key=specificity)  # the first of the deepest, a value's problem before a type's
    location, kind = tuple(problem.get("loc", ())), problem.get("type", "")
    param = param_of(location)
    if kind == "json_invalid" and (len(location) <= 1 or isinstance(location[1], int)):  # FastAPI's parse error
        reason = (problem.get("ctx") or {}).get("error", "it does not parse")
        return RequestError(f"The request body is not valid JSON: {reason}.", None, "invalid_request_body", 422)
    context = problem.get("ctx") or {}
    if kind in ("union_tag_invalid", "union_tag_not_found") and "discriminator" in context:
        extra = str(context["discriminator"]).strip("'")  # the field that picks the union member: `role`
        param = f"{param}.{extra}" if param else extra
    if (extra := context.get("field")) is not None:  # a model's own check names its field
        param = f"{param}.{extra}" if param else extra
    if param is None:
        return RequestError(
            "The request body must be a JSON object of the endpoint's fields.", None, "invalid_request_body", 422
        )
    if kind == "extra_forbidden":
        status = 422 if "." not in param and "[" not in param else 400  # a top-level field, as transformers
        return RequestError(
            f"`{param}` is not a field of this endpoint: /openapi.json lists the fields it takes.",
            param,
            "unknown_parameter",
            status,
        )
    message = str(problem.get("msg", "is not valid"))
    if kind in OWN_ERRORS:
        text = f"`{param}` {message}."
    elif kind == "missing":
        text, kind = f"`{param}` is missing.", "missing_required_parameter"
    else:
        text = f"`{param}`: {message}, got {shown(problem.get('input'))}."
        kind = "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"
    description = (descriptions or {}).get(param)
    return RequestError(f"{text} It takes {description}." if description else text, param, kind)


# ---------------------------------------------------------------------------------------------------------------
# Checks across fields and against the served model

# What transformers' continuous batching does not apply per request (its engine takes only the prompt,
# max_new_tokens and the end-of-sequence ids): refused there unless left out or neutral, instead of dropped.
NOT_BATCHED = {"stop": (), "logit_bias": ({},), "frequency_penalty": (0, 0.0), "seed": ()}


def check_request(request: Any, served: ServedModel) -> TokenRequest:
    """A validated request against the served model; what it asks for."""
    if request.model is not None and request.model != served.name:
        raise RequestError(
            f"The model `{request.model}` does not exist on this server: it is pinned to `{served.name}`. Send that "
            "name or leave `model` out.",
            "model",
            "model_not_found",
            404,
        )
    bias = getattr(request, "logit_bias", None) or {}
    outside = [token for token in bias if served.vocab_size is not None and int(token) >= served.vocab_size]
    if outside:
        raise RequestError(
            f"`logit_bias` key {outside[0]!r} is not a token id of the model: take one from 0 to "
            f"{served.vocab_size - 1}.",
            "logit_bias",
        )
    options = request.generation_config
    if options is not None and (options.num_beams or 1) > 1 and request.stream:
        raise RequestError(
            "`generation_config.num_beams` above 1 cannot stream (transformers streams one sequence): leave `stream` "
            "out or use num_beams 1.",
            "generation_config.num_beams",
            "unsupported_value",
        )
    check_contradictions(request)
    if served.continuous_batching:
        for name, neutral in NOT_BATCHED.items():
            value = getattr(request, name, None)
            if value is not None and not any(value == choice and type(value) is not bool for choice in neutral):
                raise RequestError(
                    f"`{name}` is not applied by continuous batching, which this server runs: leave it out, or serve "
                    "without --continuous-batching.",
                    name,
                    "unsupported_parameter",
                )
    return request.token_request()


# The fields that ask for the completion's length (`generation_config.max_new_tokens` besides).
MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def check_contradictions(request: Any) -> None:
    """Fields that ask for two things at once, refused naming both, on both paths (transformers honoured one of them
    without a word): two lengths, temperatures or top_p that differ (a top-level field and its `generation_config`
    twin), more `min_new_tokens` than the completion may have, a `temperature` of 0 (greedy) with `do_sample` true,
    or above 0 (sampling) with `do_sample` false."""
    options = request.generation_config
    lengths = {name: value for name in MAX_TOKEN_FIELDS if (value := getattr(request, name, None)) is not None}
    if options is not None and options.max_new_tokens is not None:
        lengths["generation_config.max_new_tokens"] = options.max_new_tokens
    pairs = [list(lengths.items())]
    for name in ("temperature", "top_p"):
        given = getattr(request, name, None), getattr(options, name, None)
        pairs.append([(name, given[0]), (f"generation_config.{name}", given[1])] if None not in given else [])
    for fields in pairs:
        if len({value for _, value in fields}) > 1:
            (first, one), (second, other) = fields[:2]
            raise RequestError(
                f"`{first}` {one} and `{second}` {other} set the same thing to different values: give one of them.",
                second,
                "conflicting_values",
            )
    if options is None:
        return
    asked = request.token_request()
    if (
        options.min_new_tokens is not None
        and asked.max_tokens is not None
        and options.min_new_tokens > asked.max_tokens
    ):
        raise RequestError(
            f"`generation_config.min_new_tokens` {options.min_new_tokens} is above `{asked.param}` {asked.max_tokens}: "
            "a completion cannot be longer than its most tokens. Lower one of them.",
            "generation_config.min_new_tokens",
            "conflicting_values",
        )
    if request.temperature is not None and options.do_sample is not None:
        samples = request.temperature >= SAMPLING_EPS
        if samples != options.do_sample:
            what = "samples" if samples else "decodes greedily"
            raise RequestError(
                f"`temperature` {request.temperature} {what}, and `generation_config.do_sample` {options.do_sample} "
                "says the opposite: leave one of them out, or make them agree.",
                "generation_config.do_sample",
                "conflicting_values",
            )


# The generation settings the continuous-batching engine shares among the requests of a batch; the sampling ones
# matter only where it samples.
BATCH_SHARED = ("do_sample", "num_beams", "repetition_penalty", "no_repeat_ngram_size", "min_new_tokens")
BATCH_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "typical_p")
TOP_LEVEL = {"do_sample": "temperature", "temperature": "temperature", "top_p": "top_p"}
# What GenerationConfig does with a setting left unset (None).
UNSET = {"do_sample": False, "num_beams": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
UNSET |= {"min_new_tokens": 0, "temperature": 1.0, "top_p": 1.0, "top_k": 50, "typical_p": 1.0}


def effective(config: Any, name: str) -> Any:
    value = getattr(config, name, None)
    if name in ATTENTION_FLAG_NAMES:
        return bool(value)
    return UNSET.get(name) if value is None else value


def setting_param(name: str, request: Any) -> str:
    """The request field that set a generation setting: its top-level field, else its generation_config entry."""
    top = TOP_LEVEL.get(name)
    options = request.generation_config
    if options is not None and getattr(options, name, None) is not None:
        return f"generation_config.{name}"
    return top if top is not None and getattr(request, top, None) is not None else f"generation_config.{name}"


def check_generation(config: Any, request: Any, engine: Any | None) -> None:
    """The generation config a request built: the attention flags' combination, and with continuous batching
    (`engine`: the settings its batches share), nothing the engine would not apply."""
    flags = {name: getattr(config, name, None) for name in ATTENTION_FLAG_NAMES}
    try:
        check_flag_combination(flags)
    except ValueError as error:
        asked = [name for name in ATTENTION_FLAG_NAMES if getattr(request.generation_config, name, None)]
        param = f"generation_config.{asked[0]}" if asked else "generation_config"
        raise RequestError(f"`{param}`: {error} (the server's own flags are the defaults)", param) from None
    try:
        config.validate()
    except ValueError as error:  # GenerationConfig's own checks of the combination
        raise RequestError(f"`generation_config` cannot be used: {error}", "generation_config") from None
    if engine is None:
        return
    names = BATCH_SHARED + ATTENTION_FLAG_NAMES + (BATCH_SAMPLING if effective(engine, "do_sample") else ())
    for name in names:
        value, shared = effective(config, name), effective(engine, name)
        if value != shared:
            param = setting_param(name, request)
            asked = (
                f"temperature {request.temperature}, which samples" if param == "temperature" else f"{name} {value}"
            )
            raise RequestError(
                f"`{param}` cannot be applied: continuous batching runs every request of a batch with the server's "
                f"generation settings ({describe_sampling(engine)}; {name} {shared}), and this request asks for "
                f"{asked}. Leave it out or match the server's, or serve without --continuous-batching.",
                param,
                "unsupported_value",
            )


def describe_sampling(config: Any) -> str:
    if not effective(config, "do_sample"):
        return "greedy decoding"
    sampling = ", ".join(f"{name} {effective(config, name)}" for name in ("temperature", "top_p", "top_k"))
    return f"sampling at {sampling}"
