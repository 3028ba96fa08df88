"""The requests of issue 31, sent as a client would, on the sequential and the continuous-batching path: each gets
a 2xx that honours it or a 4xx in OpenAI's shape naming the field, never a 500 or a silent 200, and the server
answers the next good request. Also the published schema: every field of the generation endpoints with its type
and range.
"""

import http.client
import json
import urllib.request

import pytest
import torch
from transformers import AutoTokenizer

from optimum.habana.transformers import GaudiLlamaForCausalLM
from tests.helpers import save_tiny_checkpoint
from tests.serving.servers import TIMEOUT_S, RunningServer, sequential_and_continuous_batching


CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
HELLO = [{"role": "user", "content": "Hello there"}]
CACHE = {"cb_block_size": 16, "cb_num_blocks": 16, "cb_max_batch_tokens": 64}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama_hostile"))


@pytest.fixture(scope="module")
def servers(checkpoint):
    yield from sequential_and_continuous_batching(checkpoint, **CACHE)


@pytest.fixture(params=["sequential", "cb"])
def server(request, servers):
    return servers[request.param]


def post(server: RunningServer, path: str, body: dict):
    """The body as JSON text with Python's escapes: a lone surrogate travels as `\\ud800`, as a client sends it."""
    return server.post(path, json.dumps(body).encode())


def refused(server: RunningServer, path: str, body: dict, param: str, status: int = 400) -> dict:
    code, answer, _ = post(server, path, body)
    assert code == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error", answer
    assert f"`{param}`" in answer["error"]["message"], answer
    code, good, _ = post(server, CHAT, {"messages": HELLO, "max_tokens": 2, "temperature": 0})
    assert code == 200 and good["usage"]["completion_tokens"] == 2, good
    return answer["error"]


def chat(**fields) -> dict:
    return {"messages": HELLO, "max_tokens": 3, **fields}


HOSTILE = {
    "temperature-of-400-digits": (CHAT, chat(temperature=10**400), "temperature"),
    "temperature-1e400": (CHAT, chat(temperature=float("inf")), "temperature"),
    "logit-bias-superscript-two": (CHAT, chat(logit_bias={"²": 1}), "logit_bias"),
    "logit-bias-5000-digits": (CHAT, chat(logit_bias={"1" * 5000: 1}), "logit_bias"),
    "lone-surrogate-in-content": (CHAT, chat(messages=[{"role": "user", "content": "caf\ud800e"}]), "messages[0].content"),
    "template-kwargs-tokenize": (CHAT, chat(chat_template_kwargs={"tokenize": False}), "chat_template_kwargs"),
    "template-kwargs-generation-prompt": (
        CHAT,
        chat(chat_template_kwargs={"add_generation_prompt": False}),
        "chat_template_kwargs",
    ),
    "flag-as-a-string": (
        CHAT,
        chat(generation_config=json.dumps({"use_flash_attention": "false"})),
        "generation_config.use_flash_attention",
    ),
    "recompute-without-flash": (
        CHAT,
        chat(generation_config={"flash_attention_recompute": True}),
        "generation_config.flash_attention_recompute",
    ),
    "repetition-penalty-0": (
        CHAT,
        chat(generation_config=json.dumps({"repetition_penalty": 0})),
        "generation_config.repetition_penalty",
    ),
    "do-sample-yes": (CHAT, chat(generation_config=json.dumps({"do_sample": "yes"})), "generation_config.do_sample"),
    "unknown-generation-argument": (CHAT, chat(generation_config={"no_such": 1}), "generation_config.no_such"),
    "user-a-number": (CHAT, chat(user=5), "user"),
    "function-call-arguments-not-json": (
        RESPONSES,
        {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{not json"}]},
        "input[0].arguments",
    ),
    "text-format-a-string": (RESPONSES, {"input": "Hello", "text": {"format": "json"}}, "text.format"),
    "text-a-string": (RESPONSES, {"input": "Hello", "text": "hello"}, "text"),
    "text-format-json-object": (RESPONSES, {"input": "Hello", "text": {"format": {"type": "json_object"}}}, "text.format.type"),
    "input-item-type-a-list": (RESPONSES, {"input": [{"type": ["message"]}]}, "input[0]"),
    "input-reasoning-only": (RESPONSES, {"input": [{"type": "reasoning", "summary": []}]}, "input"),
    "beams-with-a-stream": (
        CHAT,
        chat(stream=True, generation_config={"num_beams": 2}),
        "generation_config.num_beams",
    ),
    # issue 36
    "five-stop-sequences": (CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    "a-stop-sequence-of-65-characters": (CHAT, chat(stop=["s" * 65]), "stop[0]"),
    "a-web-search-tool": (RESPONSES, {"input": "Hello", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    "a-chat-tool-of-another-type": (CHAT, chat(tools=[{"type": "custom", "custom": {"name": "f"}}]), "tools[0].type"),
    "min-new-tokens-above-max-tokens": (
        CHAT,
        chat(max_tokens=3, generation_config={"min_new_tokens": 5}),
        "generation_config.min_new_tokens",
    ),
    "temperature-0-with-sampling": (
        CHAT,
        chat(temperature=0, generation_config={"do_sample": True}),
        "generation_config.do_sample",
    ),
    "a-sampling-temperature-without-sampling": (
        CHAT,
        chat(temperature=0.7, generation_config={"do_sample": False}),
        "generation_config.do_sample",
    ),
    # the fresh round's (issue 36): two fields set the same setting differently
    "max-tokens-and-max-completion-tokens": (CHAT, chat(max_tokens=2, max_completion_tokens=3), "max_completion_tokens"),
    "max-output-tokens-and-max-new-tokens": (
        RESPONSES,
        {"input": "Hello", "max_output_tokens": 2, "generation_config": {"max_new_tokens": 3}},
        "generation_config.max_new_tokens",
    ),
    "two-temperatures": (CHAT, chat(temperature=0.5, generation_config={"temperature": 0.7}), "generation_config.temperature"),
    "two-top-p": (CHAT, chat(top_p=0.5, generation_config={"top_p": 0.7}), "generation_config.top_p"),
}  # fmt: skip


@pytest.mark.parametrize("path, body, param", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_request_is_a_400_naming_its_field(path, body, param, server):
    refused(server, path, body, param)


def test_each_refusal_names_its_real_cause(server):
    """Contradictions name both fields; a tool's type, a body's content type, its nesting and its numbers are named."""
    error = refused(
        server, CHAT, chat(max_tokens=3, generation_config={"min_new_tokens": 5}), "generation_config.min_new_tokens"
    )
    assert "`max_tokens` 3" in error["message"] and error["code"] == "conflicting_values"
    error = refused(
        server, CHAT, chat(temperature=0, generation_config={"do_sample": True}), "generation_config.do_sample"
    )
    assert "`temperature` 0" in error["message"] and "decodes greedily" in error["message"]
    error = refused(server, RESPONSES, {"input": "Hello", "tools": [{"type": "web_search"}]}, "tools[0].type")
    assert '"web_search" is not a tool type this server runs' in error["message"]
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        code, answer, _ = server.post(CHAT, json.dumps(chat()).encode(), headers={"Content-Type": content_type})
        assert code == 415 and f"Content-Type {content_type!r}" in answer["error"]["message"], answer
    for missing in (None, ""):  # no header at all (urllib would add a form's), or an empty one
        connection = http.client.HTTPConnection(server.base_url.removeprefix("http://"), timeout=30)
        connection.putrequest("POST", CHAT, skip_accept_encoding=True)
        body = json.dumps(chat()).encode()
        connection.putheader("Content-Length", str(len(body)))
        if missing is not None:
            connection.putheader("Content-Type", missing)
        connection.endheaders(body)
        response = connection.getresponse()
        answer = json.loads(response.read())
        connection.close()
        assert response.status == 415 and "without a Content-Type header" in answer["error"]["message"], answer
    for body, words in (
        (b"[" * 50_000 + b"]" * 50_000, "nest deeper than the parser allows"),
        (b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}", "an integer of more than 4300 digits"),
        (b'{"messages": "caf\xe9"}', "not UTF-8 text"),
    ):
        code, answer, _ = server.post(CHAT, body)
        assert code == 400 and words in answer["error"]["message"], answer
    code, good, _ = post(server, CHAT, {"messages": HELLO, "max_tokens": 2})
    assert code == 200


def test_transcription_is_not_served(server):
    code, answer, _ = server.post("/v1/audio/transcriptions", b"", headers={"Content-Type": "multipart/form-data"})
    assert code == 404 and "/v1/audio/transcriptions is not served here" in answer["error"]["message"]


def test_an_empty_logit_bias_biases_nothing(servers):
    """Found by the long fuzz run: transformers' processor refuses an empty bias (a 500 before)."""
    code, answer, _ = post(servers["sequential"], CHAT, chat(logit_bias={}))
    assert code == 200 and answer["usage"]["completion_tokens"] == 3


def test_responses_input_may_start_with_a_function_call(server):
    """Found by the long fuzz run: transformers read such an array as text parts (a KeyError, a 500)."""
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    body = {"input": [call, {"role": "user", "content": "Hello"}], "max_output_tokens": 3}
    code, answer, _ = post(server, RESPONSES, body)
    assert code == 200 and answer["status"] == "completed", answer


def test_continuous_batching_refuses_what_its_batch_does_not_apply(servers):
    server = servers["cb"]
    error = refused(server, CHAT, chat(generation_config={"num_beams": 2}), "generation_config.num_beams")
    assert error["code"] == "unsupported_value" and "continuous batching" in error["message"]
    error = refused(server, CHAT, chat(temperature=0.7), "temperature")
    assert "greedy decoding" in error["message"] and "temperature 0.7, which samples" in error["message"]
    refused(server, CHAT, chat(seed=3), "seed")


@pytest.fixture(scope="module")
def expected_beams(checkpoint) -> str:
    """The tiny model's answer to HELLO with two beams, from its own generate()."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = GaudiLlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**ids, max_new_tokens=3, num_beams=2, do_sample=False)
    return tokenizer.decode(output[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def test_the_sequential_path_honours_beams(servers, expected_beams):
    code, answer, _ = post(servers["sequential"], CHAT, chat(generation_config={"num_beams": 2}))
    assert code == 200 and answer["choices"][0]["message"]["content"] == expected_beams


def test_a_temperature_above_0_samples_on_the_sequential_path(servers):
    """OpenAI's meaning (transformers kept the model's greedy config and ignored the temperature)."""
    server = servers["sequential"]
    answers = set()
    for seed in range(4):
        code, answer, _ = post(server, CHAT, chat(max_tokens=8, temperature=2.0, seed=seed))
        assert code == 200, answer
        answers.add(answer["choices"][0]["message"]["content"])
    assert len(answers) > 1


def test_the_schema_publishes_every_field_with_its_type_and_range(servers):
    with urllib.request.urlopen(f"{servers['sequential'].base_url}/openapi.json", timeout=TIMEOUT_S) as response:
        schema = json.load(response)
    bodies = schema["components"]["schemas"]
    chat_body = bodies["ChatCompletionRequest"]
    assert chat_body["additionalProperties"] is False and chat_body["required"] == ["messages"]
    temperature = chat_body["properties"]["temperature"]["anyOf"][0]
    assert temperature == {"type": "number", "minimum": 0.0, "maximum": 2.0}
    max_tokens = chat_body["properties"]["max_tokens"]["anyOf"][0]
    assert max_tokens["type"] == "integer" and max_tokens["minimum"] == 1
    operation = schema["paths"]["/v1/responses"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    assert {"200", "400", "422"} <= set(operation["responses"])
    assert "/v1/audio/transcriptions" not in schema["paths"] and "/reset" not in schema["paths"]
