"""The request fields' types, written from OpenAI's API reference, each with the range this server honours.

FastAPI publishes them in `/openapi.json` and pydantic checks every request against them before a handler runs, in
strict mode: `"yes"` is not a boolean, `1.5` is not an integer (`1e6` is, as JSON Schema says), a number is not a
string. Values outside a range,
strings that are not text (a lone surrogate, which no tokenizer encodes), numbers that are not finite and keys
that are not token ids are refused with the field named (`checks.openai_error`). Three kinds of field beyond the
honoured ones: `refused` (would change the answer, not implemented: a 400 when set, published as null), `only(...)`
(honoured in the values given, published as their enum, a 400 otherwise) and fields documented as accepted and
ignored (they only label a request).
"""

import inspect
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    Json,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError, core_schema
from transformers import PreTrainedTokenizerBase


class Strict(BaseModel):
    """Every request model: strict types, no field it does not declare."""

    model_config = ConfigDict(strict=True, extra="forbid")


def utf8(value: str) -> str:
    """Refuse what JSON allows and no tokenizer encodes: a lone surrogate (`"caf\\ud800e"`)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PydanticCustomError(
            "invalid_value",
            "is not valid Unicode text: a lone surrogate at character {position}",
            {"position": error.start},
        ) from None
    return value


def json_text(value: Any, depth: int = 0) -> Any:
    """Every string and key of a free-form JSON value checked as `utf8` does (bounded depth)."""
    if depth > 32:
        raise PydanticCustomError("invalid_value", "is nested deeper than 32 levels")
    if isinstance(value, str):
        utf8(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            utf8(key)
            json_text(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            json_text(item, depth + 1)
    return value


Text = Annotated[str, AfterValidator(utf8)]
NonEmpty = Annotated[str, Field(min_length=1), AfterValidator(utf8)]
JsonObject = Annotated[dict[str, Any], AfterValidator(json_text)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


def bounded(low: float | None = None, high: float | None = None, *, above: bool = False) -> Any:
    """A finite number from `low` (excluded when `above`) to `high`."""
    return Annotated[float, Field(gt=low if above else None, ge=None if above else low, le=high, allow_inf_nan=False)]


def whole(value: Any) -> Any:
    """A number JSON Schema calls an integer (`1.0`, `1e6`) as the int it is; anything else unchanged (and then
    refused unless it is an int)."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def integer(low: int | None = None, high: int | None = None) -> Any:
    return Annotated[int, Field(ge=low, le=high), BeforeValidator(whole)]


class Only:
    """Honoured in the `allowed` values only (JSON equality: true is not 1), which the schema publishes as its enum;
    any other is a 400 `unsupported_value` that says why."""

    def __init__(self, *allowed: Any, hint: str = "") -> None:
        self.allowed, self.hint = allowed, hint
        self.shown = " or ".join(json.dumps(choice) for choice in allowed)

    def check(self, value: Any) -> Any:
        if value is not None and not any(same(value, choice) for choice in self.allowed):
            raise PydanticCustomError(
                "unsupported_value",
                "{value} is not supported by this server{hint}; it accepts only {shown}",
                {"value": json.dumps(value)[:80], "hint": f" ({self.hint})" if self.hint else "", "shown": self.shown},
            )
        return value

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        return {
            "enum": list(self.allowed),
            "description": f"only {self.shown}" + (f": {self.hint}" if self.hint else ""),
        }


class Refused(Only):
    """Would change the answer and is not implemented: a 400 `unsupported_parameter` in any value but null, which
    the schema publishes as the only value."""

    def check(self, value: Any) -> Any:
        if value is not None:
            raise PydanticCustomError(
                "unsupported_parameter", "is not supported by this server: {hint}", {"hint": self.hint}
            )
        return value

    def __get_pydantic_json_schema__(self, schema: Any, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        return {"type": "null", "description": f"not supported: {self.hint}"}


only = Only


def refused(hint: str) -> Refused:
    return Refused(hint=hint)


def same(value: Any, choice: Any) -> bool:
    """JSON equality, where true is not 1."""
    return isinstance(value, bool) == isinstance(choice, bool) and value == choice


def json_arguments(value: str) -> str:
    """A tool call's `arguments`: the JSON text of an object (chat templates iterate it as one)."""
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        raise PydanticCustomError("invalid_value", "is not JSON: give the JSON text of an object") from None
    if not isinstance(parsed, dict):
        raise PydanticCustomError("invalid_value", "must be the JSON text of an object")
    json_text(parsed)
    return value


# A string holding the JSON text of an object: published with a format of its own, which fuzzers can be taught.
JSON_OBJECT_TEXT = {"type": "string", "format": "json-object", "description": "the JSON text of an object"}
Arguments = Annotated[str, AfterValidator(json_arguments), WithJsonSchema(JSON_OBJECT_TEXT)]


def one_of(values: tuple[str, ...], what: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value not in values:
            raise PydanticCustomError(
                "unsupported_value", "{value} is not {what}: take {values}", {"value": json.dumps(value)[:80],
                "what": what, "values": " or ".join(json.dumps(v) for v in values)}
            )  # fmt: skip
        return value

    return check


def text_part_type(*types: str) -> Any:
    """A content part's `type`: the served models read text only (an image or audio part is refused, not dropped)."""
    return Annotated[
        str,
        AfterValidator(one_of(types, "a text part: this model reads text only")),
        WithJsonSchema({"enum": list(types)}),
    ]


# apply_chat_template's own parameters, which the handlers pass themselves: not template variables.
TEMPLATE_PARAMETERS = frozenset(
    name
    for name in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    if name not in ("self", "kwargs")
) | {"load_audio_from_video"}


def template_variables(value: dict[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs`: variables of the model's chat template, never apply_chat_template's own parameters
    (`tokenize`, `add_generation_prompt`, ...), which the server sets (transformers would fail with a TypeError)."""
    taken = sorted(TEMPLATE_PARAMETERS & set(value))
    if taken:
        raise PydanticCustomError(
            "unsupported_value",
            "holds {names}, which the server sets itself: give only the chat template's variables (e.g. {example})",
            {"names": ", ".join(taken), "example": '{"enable_thinking": true}'},
        )
    return json_text(value)


TemplateVariables = Annotated[dict[str, Any], AfterValidator(template_variables)]


# Below this a temperature is greedy decoding (its limit): logits divided by 1e-141 overflow to inf, and sampling
# from them fails (vLLM's _SAMPLING_EPS is the same).
SAMPLING_EPS = 1e-5


class GenerationOptions(Strict):
    """transformers' `generation_config` extension: the GenerationConfig arguments this server honours."""

    max_new_tokens: integer(1, 2**31) | None = None
    min_new_tokens: integer(0, 2**31) | None = None
    do_sample: bool | None = None
    temperature: bounded(SAMPLING_EPS, 100) | None = None
    top_k: integer(0, 2**31) | None = None
    top_p: bounded(0, 1, above=True) | None = None
    min_p: bounded(0, 1) | None = None
    typical_p: bounded(0, 1, above=True) | None = None
    repetition_penalty: bounded(0.01, 100) | None = None
    no_repeat_ngram_size: integer(0, 2**31) | None = None
    num_beams: integer(1, 16) | None = None
    length_penalty: bounded(-100, 100) | None = None
    early_stopping: bool | Literal["never"] | None = None
    num_return_sequences: Annotated[integer(1, 128), only(1, hint="one choice per request")] | None = None
    use_flash_attention: bool | None = None
    flash_attention_recompute: bool | None = None
    flash_attention_causal_mask: bool | None = None
    flash_attention_fast_softmax: bool | None = None
    attn_softmax_bf16: bool | None = None


GenerationConfigField = Annotated[
    Annotated[Json[GenerationOptions], WithJsonSchema(JSON_OBJECT_TEXT)] | GenerationOptions,
    Field(description="GenerationConfig arguments (transformers' extension): an object, or its JSON text"),
]


class TextPart(Strict):
    type: text_part_type("text")
    text: Text


class FunctionCall(Strict):
    name: NonEmpty
    arguments: Arguments


class ToolCall(Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class FunctionTool(Strict):
    """A tool of type `function`, the only kind this server runs: its type is checked before its other fields, so
    that a `web_search` tool is refused for its type, not for a missing `name`."""

    @model_validator(mode="before")
    @classmethod
    def function_type(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise PydanticCustomError(
                "unsupported_value",
                '{value} is not a tool type this server runs: it runs function tools only (type "function")',
                {"value": json.dumps(value.get("type"))[:80], "field": "type"},
            )
        return value


class Tool(FunctionTool):
    type: Literal["function"]
    function: FunctionDefinition


class FlatTool(FunctionTool, FunctionDefinition):
    """A Responses tool: the function's fields beside `type`."""

    type: Literal["function"]


ToolChoice = Annotated[
    Literal["auto", "none", "required"],
    only("auto", "none", hint='the model chooses by itself ("auto"), or "none" offers it no tool'),
]
# OpenAI's limit of 4 stop sequences, each bounded. generate() matches them on each row's last tokens (a window as
# long as the longest stop string: `TailStopStringCriteria`, in time linear in the text). The bound dates from
# transformers' `StopStringCriteria`, whose tables over the vocabulary took seconds per request; it stays, so that
# the same requests are valid and the window stays short.
STOP_MAX_CHARACTERS = 64
StopString = Annotated[str, Field(min_length=1, max_length=STOP_MAX_CHARACTERS), AfterValidator(utf8)]
Stop = Annotated[
    StopString | Annotated[list[StopString], Field(min_length=1, max_length=4)],
    Field(description=f"1 to 4 stop sequences of 1 to {STOP_MAX_CHARACTERS} characters"),
]
TokenId = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
LogitBias = Annotated[dict[TokenId, bounded(-100, 100)], Field(max_length=1024)]
Seed = integer(-(2**63), 2**64 - 1)


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class GenerationRequest(Strict):
    """The fields of every generation endpoint."""

    model: Text | None = Field(None, description="the served model's name (as /v1/models lists it), or left out")
    stream: bool | None = None
    temperature: bounded(0, 2) | None = Field(None, description="from 0 to 2 (below 1e-5: greedy)")
    top_p: bounded(0, 1, above=True) | None = Field(None, description="above 0, up to 1")
    seed: Seed | None = Field(None, description="a 64-bit integer")
    generation_config: GenerationConfigField | None = None
    # Accepted and ignored: they only label a request.
    user: Text | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[Text, Field(max_length=512)]], Field(
        max_length=16)] | None = None  # fmt: skip
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    parallel_tool_calls: bool | None = None
