"""The request bodies of `/v1/chat/completions`, `/v1/completions` and `/v1/responses`, and what each hands to
transformers' handler.

Written from OpenAI's API reference, field by field (the `openai` package's parameter types are TypedDicts that
take every union member OpenAI serves, without ranges; this server honours fewer): `fields` has the types. Each body
hands transformers only the fields its handler reads, in the shapes it reads them; the generation settings
(`generation_config`, sampling) are applied by `handlers`, the completion length by `generation`.
"""

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from .checks import TokenRequest
from .fields import (
    Arguments,
    FlatTool,
    FunctionCall,
    GenerationRequest,
    JsonObject,
    LogitBias,
    NonEmpty,
    Stop,
    StreamOptions,
    Strict,
    TemplateVariables,
    Text,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    bounded,
    integer,
    only,
    refused,
    text_part_type,
)


MaxTokens = integer(1, 2**31)
Frequency = Annotated[
    bounded(-1, 2, above=True), Field(description="above -1 (a repetition penalty 1 + value), up to 2")
]
Presence = Annotated[bounded(-2, 2), only(0, hint="not implemented")]
Verbosity = Literal["low", "medium", "high"]


def problem(kind: str, message: str, field: str) -> PydanticCustomError:
    """An error of a model's own check, naming its `field` (pydantic places it on the model)."""
    return PydanticCustomError(kind, message, {"field": field})


Content = Text | Annotated[list[TextPart], Field(max_length=1024)]


class TextMessage(Strict):
    """A system, developer or user message: its text (a string or text parts)."""

    role: Literal["system", "developer", "user"]
    content: Content
    name: Text | None = Field(None, description="accepted and not passed to the chat template")


class AssistantMessage(Strict):
    """An earlier answer: its text, or the tool calls it made."""

    role: Literal["assistant"]
    content: Content | None = None
    name: Text | None = Field(None, description="accepted and not passed to the chat template")
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None
    refusal: Text | None = Field(None, description="accepted and ignored (an earlier answer's refusal)")


class ToolMessage(Strict):
    """A tool's answer to one of the assistant's calls."""

    role: Literal["tool"]
    content: Content
    tool_call_id: Text


Message = Annotated[TextMessage | AssistantMessage | ToolMessage, Discriminator("role")]


class ResponseFormat(Strict):
    type: Annotated[Literal["text", "json_object", "json_schema"], only("text", hint="it answers in plain text")]
    json_schema: JsonObject | None = None


def characters(value: Any) -> int:
    """The characters of the text a chat template renders from `value`: strings, text parts, the messages' and
    items' contents, tool calls (names and arguments), tool outputs. What it does not render (a message's `name`,
    ids) is not counted."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(map(characters, value))
    if isinstance(value, FunctionCall | FunctionCallItem):
        return len(value.name) + len(value.arguments)
    return sum(characters(getattr(value, name, None)) for name in RENDERED_FIELDS)


RENDERED_FIELDS = ("content", "text", "tool_calls", "function", "output")


class Generation(GenerationRequest):
    """What the three endpoints share beyond their fields: the completion length a `generation_config` asks for."""

    def configured_tokens(self, prompt: str) -> TokenRequest:
        asked = self.generation_config.max_new_tokens if self.generation_config is not None else None
        return TokenRequest(asked, "generation_config.max_new_tokens", prompt)


class ChatCompletionRequest(Generation):
    """`/v1/chat/completions`."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=2048)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    frequency_penalty: Frequency | None = None
    presence_penalty: Presence | None = None
    logit_bias: LogitBias | None = Field(None, description="token ids of the vocabulary: biases from -100 to 100")
    stop: Stop | None = None
    n: Annotated[integer(1, 128), only(1, hint="one choice per request: send n requests")] | None = None
    logprobs: Annotated[bool, only(False, hint="not implemented")] | None = None
    top_logprobs: Annotated[integer(0, 20), only(0, hint="not implemented")] | None = None
    response_format: ResponseFormat | None = None
    modalities: Annotated[list[Literal["text", "audio"]], only(["text"], hint="text only")] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    chat_template_kwargs: TemplateVariables | None = Field(None, description="the chat template's variables")
    stream_options: StreamOptions | None = Field(None, description="accepted: the last chunk carries usage anyway")
    verbosity: Verbosity | None = Field(None, description="accepted and ignored")
    audio: Annotated[JsonObject, refused("this server answers in text")] | None = None
    prediction: Annotated[JsonObject, refused("not implemented")] | None = None
    web_search_options: Annotated[JsonObject, refused("not implemented")] | None = None
    functions: Annotated[list[JsonObject], refused("use `tools`")] | None = None
    function_call: Annotated[Text | JsonObject, refused("use `tools`")] | None = None
    reasoning_effort: Annotated[
        Literal["none", "minimal", "low", "medium", "high", "xhigh"],
        refused('use `chat_template_kwargs` (e.g. {"enable_thinking": true}) where the template has it'),
    ] | None = None  # fmt: skip

    def prompt_characters(self) -> int:
        return characters(self.messages)

    def token_request(self) -> TokenRequest:
        for name in ("max_completion_tokens", "max_tokens"):
            if getattr(self, name) is not None:
                return TokenRequest(getattr(self, name), name, "messages")
        return self.configured_tokens("messages")

    def for_transformers(self) -> dict[str, Any]:
        fields = {"model", "messages", "max_tokens", "max_completion_tokens", "frequency_penalty", "logit_bias"}
        fields |= {"stop", "seed", "stream", "temperature", "top_p", "chat_template_kwargs"}
        body = self.model_dump(
            include=fields, exclude_none=True, exclude={"messages": {"__all__": {"name", "refusal"}}}
        )
        if not self.logit_bias:
            body.pop("logit_bias", None)  # {} biases nothing (transformers' processor refuses an empty one)
        if self.tools and self.tool_choice != "none":  # OpenAI's "none": the model is offered no tool
            body["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        return body


class CompletionRequest(Generation):
    """`/v1/completions`: one prompt."""

    prompt: NonEmpty = Field(description="one non-empty string (lists of prompts and token ids are not supported)")
    suffix: Text | None = None
    max_tokens: MaxTokens | None = None
    frequency_penalty: Frequency | None = None
    presence_penalty: Presence | None = None
    stop: Stop | None = None
    n: Annotated[integer(1, 128), only(1, hint="one choice per request: send n requests")] | None = None
    best_of: Annotated[integer(1, 20), only(1, hint="one choice per request")] | None = None
    echo: Annotated[bool, only(False, hint="not implemented")] | None = None
    logprobs: Annotated[integer(0, 5), refused("not implemented")] | None = None
    logit_bias: Annotated[LogitBias, only({}, hint="/v1/chat/completions applies it")] | None = None
    stream_options: StreamOptions | None = Field(None, description="accepted: the last chunk carries usage anyway")

    def prompt_characters(self) -> int:
        return len(self.prompt)

    def token_request(self) -> TokenRequest:
        if self.max_tokens is not None:
            return TokenRequest(self.max_tokens, "max_tokens", "prompt")
        return self.configured_tokens("prompt")

    def for_transformers(self) -> dict[str, Any]:
        fields = {"model", "prompt", "suffix", "max_tokens", "frequency_penalty", "stop", "seed", "stream"}
        return self.model_dump(include=fields | {"temperature", "top_p"}, exclude_none=True)


class InputText(Strict):
    """A text part of a Responses message (or of a flat `input` array: one user message)."""

    type: text_part_type("input_text", "output_text", "text")
    text: Text
    annotations: list[JsonObject] | None = Field(None, description="accepted and ignored")


class ConversationItem(Strict):
    """What every item of a Responses conversation may carry besides its content (as an earlier response gave it)."""

    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class InputMessage(ConversationItem):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[InputText], Field(max_length=1024)]


class FunctionCallItem(ConversationItem):
    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: Arguments


class FunctionCallOutputItem(ConversationItem):
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: Text


class ReasoningPart(Strict):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[JsonObject] | None = None
    content: list[ReasoningPart] | None = None
    encrypted_content: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


ITEM_TAGS = {"message", "function_call", "function_call_output", "reasoning", "input_text"}


def item_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    if "role" in value:
        return "message"
    kind = value.get("type")
    if not isinstance(kind, str):  # a list or an object is no tag (and unhashable: no TypeError from here)
        return None
    if kind in ("input_text", "output_text", "text"):
        return "input_text"
    return kind if kind in ITEM_TAGS else None


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[InputText, Tag("input_text")],
    Discriminator(
        item_kind,
        custom_error_type="invalid_value",
        custom_error_message="is not an input item: give a message (with `role`), a function_call, a "
        "function_call_output, a reasoning item, or text parts",
    ),
]


class TextFormat(Strict):
    type: Annotated[Literal["text", "json_object", "json_schema"], only("text", hint="it answers in plain text")]
    name: Text | None = None
    description: Text | None = None
    json_schema: JsonObject | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Verbosity | None = Field(None, description="accepted and ignored")


class ResponsesRequest(Generation):
    """`/v1/responses`: `stream` defaults to false, as OpenAI's does (transformers' handler streams unless told)."""

    input: NonEmpty | Annotated[list[InputItem], Field(min_length=1, max_length=2048)]
    instructions: Text | None = None
    max_output_tokens: MaxTokens | None = None
    tools: Annotated[list[FlatTool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    text: TextConfig | None = None
    chat_template_kwargs: TemplateVariables | None = Field(None, description="the chat template's variables")
    top_logprobs: Annotated[integer(0, 20), only(0, hint="not implemented")] | None = None
    background: Annotated[bool, only(False, hint="every response is answered in its request")] | None = None
    truncation: Annotated[Literal["auto", "disabled"], only("disabled", hint="a prompt past the context is a 400")] | (
        None) = None  # fmt: skip
    include: Annotated[list[Text], Field(max_length=16)] | None = Field(None, description="accepted and ignored")
    max_tool_calls: integer(1, 2**31) | None = Field(None, description="accepted and ignored")
    stream_options: StreamOptions | None = Field(None, description="accepted and ignored")
    reasoning: Annotated[JsonObject, refused("use the server's --reasoning option or `chat_template_kwargs`")] | (
        None) = None  # fmt: skip
    previous_response_id: Annotated[Text, refused("it stores no responses: send the whole conversation")] | None = None
    conversation: Annotated[Text | JsonObject, refused("it stores no conversations: send the whole conversation")] | (
        None) = None  # fmt: skip
    prompt: Annotated[JsonObject, refused("a stored prompt template: send the text in `input`")] | None = None

    @model_validator(mode="after")
    def parts_or_items(self) -> "ResponsesRequest":
        if isinstance(self.input, list):
            parts = sum(isinstance(item, InputText) for item in self.input)
            if parts and parts != len(self.input):
                raise problem(
                    "invalid_value", "mixes text parts with messages or items: give one or the other", "input"
                )
            if not self.instructions and all(isinstance(item, ReasoningItem) for item in self.input):
                raise problem("invalid_value", "holds reasoning items only: give the conversation to answer", "input")
        return self

    def prompt_characters(self) -> int:
        return characters(self.input) + characters(self.instructions)

    def token_request(self) -> TokenRequest:
        if self.max_output_tokens is not None:
            return TokenRequest(self.max_output_tokens, "max_output_tokens", "input")
        return self.configured_tokens("input")

    def for_transformers(self) -> dict[str, Any]:
        fields = {"model", "instructions", "max_output_tokens", "seed", "temperature", "top_p", "chat_template_kwargs"}
        fields |= {"parallel_tool_calls"}
        body = self.model_dump(include=fields, exclude_none=True)
        body["stream"] = bool(self.stream)
        if isinstance(self.input, str):
            body["input"] = self.input
        elif all(isinstance(item, InputText) for item in self.input):  # one user message of text parts
            body["input"] = [{"role": "user", "content": [item.model_dump(exclude_none=True) for item in self.input]}]
        else:
            body["input"] = [item.model_dump(exclude_none=True, by_alias=True) for item in self.input]
        if self.tools and self.tool_choice != "none":
            body["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        return body


BODIES = {"chat": ChatCompletionRequest, "completion": CompletionRequest, "response": ResponsesRequest}
