"""Every request is checked before generation: a bad field is a 4xx in OpenAI's error shape naming the field,
never a 500, and the server answers the next good request; a prompt and `max_tokens` past the context are a 400
`context_length_exceeded`; the answer names the model as asked; streams end with `data: [DONE]`.

Two servers (tiny random Llama of 128 positions): sequential generate(), and continuous batching with a paged
cache of 96 tokens, smaller than the model's context.
"""

import json
import math
import urllib.request

import pytest
from transformers import StopStringCriteria

from optimum.habana.transformers.generation.stop_strings import TailStopStringCriteria
from tests.helpers import save_tiny_checkpoint
from tests.serving.servers import TIMEOUT_S, RunningServer, openai, sequential_and_continuous_batching


CONTEXT = 128
CACHE = {"cb_block_size": 16, "cb_num_blocks": 6, "cb_max_batch_tokens": 64}  # 96 tokens
HELLO = [{"role": "user", "content": "Hello there"}]
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
DROP = object()  # a field left out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama_checked"))


@pytest.fixture(scope="module")
def servers(checkpoint):
    yield from sequential_and_continuous_batching(checkpoint, **CACHE)


@pytest.fixture(params=["sequential", "cb"])
def server(request, servers):
    return servers[request.param]


def good_answer(server: RunningServer) -> dict:
    status, answer, _ = server.post(CHAT, {"messages": HELLO, "max_tokens": 3, "temperature": 0})
    assert status == 200, answer
    return answer


def assert_error(status: int, answer: dict, expected_status: int, param: str | None, code: str, *words: str):
    assert status == expected_status, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param and answer["error"]["code"] == code, answer
    assert answer["error"]["type"] == "invalid_request_error"
    for word in words:
        assert word in answer["error"]["message"], answer


BAD_CHAT = {
    "messages-not-a-list": ({"messages": "hi"}, "messages", "invalid_type", "valid list"),
    "messages-missing": ({"messages": DROP}, "messages", "missing_required_parameter", "missing"),
    "messages-empty": ({"messages": []}, "messages", "invalid_value", "at least 1 item"),
    "max-tokens-a-string": ({"max_tokens": "abc"}, "max_tokens", "invalid_type", "valid integer"),
    "max-tokens-2.5": ({"max_tokens": 2.5}, "max_tokens", "invalid_type", "valid integer"),
    "max-tokens-0": ({"max_tokens": 0}, "max_tokens", "invalid_value", "greater than or equal to 1"),
    "max-tokens-negative": ({"max_tokens": -5}, "max_tokens", "invalid_value", "greater than or equal to 1"),
    "max-completion-tokens-0": (
        {"max_completion_tokens": 0},
        "max_completion_tokens",
        "invalid_value",
        "or equal to 1",
    ),
    "temperature-negative": ({"temperature": -1}, "temperature", "invalid_value", "from 0 to 2"),
    "temperature-nan": ({"temperature": math.nan}, "temperature", "invalid_value", "finite number"),
    "top-p-2.5": ({"top_p": 2.5}, "top_p", "invalid_value", "above 0, up to 1"),
    "top-p-0": ({"top_p": 0}, "top_p", "invalid_value", "greater than 0"),
    "n-3": ({"n": 3}, "n", "unsupported_value", "one choice per request"),
    "stop-5": ({"stop": 5}, "stop", "invalid_type", "valid string"),
    "stop-5-strings": ({"stop": list("abcde")}, "stop", "invalid_value", "at most 4 items"),
    "unknown-role": ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "invalid_value", "user"),
    "image-part": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0].type",
        "unsupported_value",
        "text only",
    ),
    "content-missing": (
        {"messages": [{"role": "user"}]},
        "messages[0].content",
        "missing_required_parameter",
        "missing",
    ),
    "logprobs": ({"logprobs": True}, "logprobs", "unsupported_value", "not supported"),
    "presence-penalty": ({"presence_penalty": 1.0}, "presence_penalty", "unsupported_value", "not supported"),
    "frequency-penalty--1": ({"frequency_penalty": -1}, "frequency_penalty", "invalid_value", "greater than -1"),
    "logit-bias-key": ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value", "token ids"),
    "logit-bias-value": ({"logit_bias": {"5": 500}}, "logit_bias", "invalid_value", "less than or equal to 100"),
    "seed": ({"seed": "x"}, "seed", "invalid_type", "valid integer"),
    "stream-not-bool": ({"stream": "yes"}, "stream", "invalid_type", "valid boolean"),
    "tool-choice-required": ({"tool_choice": "required"}, "tool_choice", "unsupported_value", "auto"),
    "generation-config-not-json": ({"generation_config": "{x"}, "generation_config", "invalid_value", "Invalid JSON"),
    "generation-config-temperature": (
        {"generation_config": json.dumps({"temperature": -3})},
        "generation_config.temperature",
        "invalid_value",
        "greater than or equal to 0.00001",
    ),
    "response-format-json": (
        {"response_format": {"type": "json_object"}},
        "response_format.type",
        "unsupported_value",
        "plain text",
    ),
}


@pytest.mark.parametrize("fields, param, code, words", BAD_CHAT.values(), ids=BAD_CHAT.keys())
def test_a_bad_chat_field_is_a_400_naming_it_and_the_server_keeps_answering(fields, param, code, words, server):
    body = {name: value for name, value in {"messages": HELLO, **fields}.items() if value is not DROP}
    status, answer, _ = server.post(CHAT, body)
    assert_error(status, answer, 400, param, code, f"`{param}`" if "[" not in param else param, words)
    good_answer(server)


BAD_OTHERS = {
    "completion-empty-prompt": (COMPLETIONS, {"prompt": ""}, "prompt", "invalid_value", "at least 1 character"),
    "completion-no-prompt": (COMPLETIONS, {"max_tokens": 3}, "prompt", "missing_required_parameter", "missing"),
    "completion-prompt-list": (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt", "invalid_type", "lists of prompts"),
    "completion-echo": (COMPLETIONS, {"prompt": "a", "echo": True}, "echo", "unsupported_value", ""),
    "completion-best-of": (COMPLETIONS, {"prompt": "a", "best_of": 2}, "best_of", "unsupported_value", ""),
    "response-no-input": (RESPONSES, {"max_output_tokens": 3}, "input", "missing_required_parameter", "missing"),
    "response-input-a-number": (RESPONSES, {"input": 5}, "input", "invalid_type", "valid string"),
    "response-max-output-0": (
        RESPONSES,
        {"input": "a", "max_output_tokens": 0},
        "max_output_tokens",
        "invalid_value",
        "",
    ),
    "response-unknown-role": (
        RESPONSES,
        {"input": [{"role": "robot", "content": "hi"}]},
        "input[0].role",
        "invalid_value",
        "user",
    ),
    "response-previous-id": (
        RESPONSES,
        {"input": "a", "previous_response_id": "resp_1"},
        "previous_response_id",
        "unsupported_parameter",
        "stores no responses",
    ),
}


@pytest.mark.parametrize("path, body, param, code, words", BAD_OTHERS.values(), ids=BAD_OTHERS.keys())
def test_a_bad_completion_or_response_field_is_a_400_naming_it(path, body, param, code, words, servers):
    server = servers["sequential"]
    status, answer, _ = server.post(path, body)
    assert_error(status, answer, 400, param, code, words)
    good_answer(server)


def test_another_model_is_a_404_and_the_answer_names_the_model_as_asked(server):
    status, answer, _ = server.post(CHAT, {"model": "someone/else", "messages": HELLO})
    assert status == 404 and answer["error"]["code"] == "model_not_found" and server.model_id in str(answer)
    status, answer, _ = server.post(CHAT, {"model": server.model_id, "messages": HELLO, "max_tokens": 2})
    assert status == 200 and answer["model"] == server.model_id  # transformers answers "<name>@main"
    assert good_answer(server)["model"] == server.model_id


def test_models_lists_the_served_model_without_a_hub_cache(server, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no_cache"))
    models = server.client.models.list()
    assert [model.id for model in models.data] == [server.model_id]


def test_a_prompt_and_max_tokens_past_the_context_are_a_400_in_openai_words(servers):
    server = servers["sequential"]
    prompt = good_answer(server)["usage"]["prompt_tokens"]
    status, answer, _ = server.post(CHAT, {"messages": HELLO, "max_tokens": 1000})
    assert_error(
        status,
        answer,
        400,
        "max_tokens",
        "context_length_exceeded",
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested {prompt + 1000} tokens "
        f"({prompt} in the messages, 1000 in the completion).",
        f"`max_tokens` at most {CONTEXT - prompt}",
    )
    status, answer, _ = server.post(CHAT, {"messages": HELLO, "max_tokens": CONTEXT - prompt, "temperature": 0})
    assert status == 200 and answer["usage"]["total_tokens"] <= CONTEXT  # the most it takes is served


def test_a_prompt_longer_than_the_context_is_a_400(server):
    """Tokenized (150 tokens, 900 characters: the tiny vocabulary's tokens have up to 10, so it might fit)."""
    long = [{"role": "user", "content": "hello " * 150}]
    for path, body, prompt_word in (
        (CHAT, {"messages": long}, "messages"),
        (COMPLETIONS, {"prompt": "hello " * 150, "max_tokens": 2}, "prompt"),
        (RESPONSES, {"input": "hello " * 150}, "input"),
    ):
        status, answer, _ = server.post(path, body)
        assert_error(status, answer, 400, prompt_word, "context_length_exceeded", f"your {prompt_word} resulted in")
    good_answer(server)


def test_without_max_tokens_generation_is_bounded_by_the_context(servers):
    server = servers["sequential"]
    status, answer, _ = server.post(COMPLETIONS, {"prompt": "The capital of", "temperature": 0})
    assert status == 200
    assert answer["usage"]["total_tokens"] <= CONTEXT
    assert answer["choices"][0]["finish_reason"] == "length" or answer["usage"]["total_tokens"] < CONTEXT


def test_continuous_batching_refuses_what_its_cache_cannot_hold_and_keeps_serving(servers):
    server = servers["cb"]
    prompt = good_answer(server)["usage"]["prompt_tokens"]
    cache = CACHE["cb_block_size"] * CACHE["cb_num_blocks"]
    status, answer, _ = server.post(CHAT, {"messages": HELLO, "max_tokens": CONTEXT - prompt})  # fits the model
    assert_error(
        status,
        answer,
        400,
        "max_tokens",
        "context_length_exceeded",
        "KV cache (6 blocks of 16 tokens",
        f"maximum context length is {cache} tokens",
        f"`max_tokens` at most {cache - prompt}",
    )
    status, answer, _ = server.post(CHAT, {"messages": HELLO, "max_tokens": cache - prompt, "temperature": 0})
    assert status == 200 and answer["usage"]["total_tokens"] <= cache
    with urllib.request.urlopen(f"{server.base_url}/health", timeout=TIMEOUT_S) as health:
        assert health.status == 200  # the worker is alive
    status, _, _ = server.post(CHAT, {"messages": HELLO, "max_tokens": 2})
    assert status == 200


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": HELLO}), (COMPLETIONS, {"prompt": "The fused"})])
def test_streams_end_with_done(path, body, server):
    connection, response = server.open_stream(path, {**body, "max_tokens": 5, "stream": True})
    events = [event for event in response.read().decode().split("\n\n") if event]
    connection.close()
    assert response.status == 200 and events[-1] == "data: [DONE]"
    chunks = [json.loads(event[len("data: ") :]) for event in events[:-1]]
    assert all(chunk["model"] == server.model_id for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_openai_clients_read_the_errors(servers):
    client = servers["cb"].client
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=servers["cb"].model_id, messages=HELLO, n=3)
    assert refused.value.param == "n" and refused.value.code == "unsupported_value"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=servers["cb"].model_id, prompt="hello " * 300)
    assert refused.value.code == "context_length_exceeded"


def test_a_responses_request_without_stream_gets_one_json_answer(servers):
    """OpenAI's default is no streaming (transformers' handler streams unless told not to)."""
    server = servers["sequential"]
    answer = server.client.responses.create(model=server.model_id, input="Hello", max_output_tokens=3)
    assert answer.status == "completed" and answer.model == server.model_id


@pytest.mark.parametrize("name, value", [("stop", "x"), ("logit_bias", {"5": 10}), ("frequency_penalty", 0.5)])
def test_what_continuous_batching_does_not_apply_is_refused_there_and_applied_elsewhere(name, value, servers):
    body = {"messages": HELLO, "max_tokens": 3, name: value}
    status, answer, _ = servers["cb"].post(CHAT, body)
    assert_error(status, answer, 400, name, "unsupported_parameter", "continuous batching")
    status, answer, _ = servers["sequential"].post(CHAT, body)
    assert status == 200, answer


def test_stop_strings_are_matched_without_tables_over_the_vocabulary(servers, monkeypatch):
    """`stop` becomes generate()'s stop strings, matched on the answer's last tokens (`TailStopStringCriteria`,
    tests/generation/test_stop_strings.py), never by transformers' `StopStringCriteria`, whose tables over the
    vocabulary took seconds per request for SmolLM2's."""
    made = []
    init = TailStopStringCriteria.__init__

    def tables(*args, **kwargs):
        raise RuntimeError("StopStringCriteria built")  # in the server's thread: the request's 500

    monkeypatch.setattr(StopStringCriteria, "__init__", tables)
    monkeypatch.setattr(
        TailStopStringCriteria,
        "__init__",
        lambda self, tokenizer, stops: made.append(stops) or init(self, tokenizer, stops),
    )
    body = {"messages": HELLO, "max_tokens": 3, "temperature": 0, "stop": ["zz", "🙂"]}
    status, answer, _ = servers["sequential"].post(CHAT, body)
    assert status == 200 and made == [["zz", "🙂"]], answer


def test_a_model_without_a_chat_template_takes_completions_and_refuses_messages_in_words(tmp_path):
    server = RunningServer(save_tiny_checkpoint(tmp_path, chat_template=False))
    try:
        for path, body in ((CHAT, {"messages": HELLO}), (RESPONSES, {"input": "Hello"})):
            status, answer, _ = server.post(path, body)
            assert_error(status, answer, 400, None, "unsupported_endpoint", "no chat template", "/v1/completions")
        status, answer, _ = server.post(COMPLETIONS, {"prompt": "Hello", "max_tokens": 2})
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
    finally:
        server.stop()


def streamed_text(server: RunningServer, path: str, body: dict) -> tuple[str, list[str]]:
    """The joined text of a stream's chunks, and their finish reasons."""
    connection, response = server.open_stream(path, {**body, "stream": True})
    try:
        events = [line[len("data: ") :] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    finally:
        connection.close()
    assert events[-1] == "[DONE]", events
    choices = [json.loads(event)["choices"][0] for event in events[:-1] if json.loads(event).get("choices")]
    pieces = [choice.get("delta", {}).get("content") or choice.get("text") or "" for choice in choices]
    return "".join(pieces), [choice["finish_reason"] for choice in choices if choice.get("finish_reason")]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_an_answer_ends_before_its_stop_string_whole_and_streamed(servers, path):
    """OpenAI's API: "The returned text will not contain the stop sequence". transformers' server returned it, and
    the rest of the token that completed it."""
    server = servers["sequential"]
    body = {"messages": HELLO} if path == CHAT else {"prompt": "Hello there"}
    body |= {"max_tokens": 24, "temperature": 0}

    def text_of(answer: dict) -> str:
        choice = answer["choices"][0]
        return choice["message"]["content"] if path == CHAT else choice["text"]

    status, whole, _ = server.post(path, body)
    assert status == 200, whole
    text = text_of(whole)
    # two letters past the first third (a random model's text holds replacement characters, which no token spells)
    start = next(
        i for i in range(len(text) // 3, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].isalpha()
    )
    stop = text[start : start + 2]
    expected = text[: text.find(stop)]
    status, answer, _ = server.post(path, {**body, "stop": ["never-in-it", stop]})
    assert status == 200 and text_of(answer) == expected, (text, stop, answer)
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert streamed_text(server, path, {**body, "stop": stop}) == (expected, ["stop"])
