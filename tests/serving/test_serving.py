"""`python -m optimum.habana.serve`: transformers' server on the Gaudi classes, driven by real HTTP clients.

The servers run in this process (uvicorn in a thread, as transformers' own serving tests run it) on 127.0.0.1, so
that the attention calls they make can be counted; one test starts the documented command as a subprocess.
"""

import http.client
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, StableLmConfig, StableLmForCausalLM

from optimum.habana.cli.serving.command import main as serve_main
from optimum.habana.cli.serving.server import GaudiServe
from optimum.habana.transformers import GaudiLlamaForCausalLM
from optimum.habana.utils.model_loading import CACHE_ENV_VAR
from tests.helpers import count_attention_paths, free_port, save_tiny_checkpoint, train_tiny_tokenizer
from tests.serving.servers import (
    CB_ENDLESS,
    CB_OPTIONS,
    LONG_CB_CACHE,
    MAX_TOKENS,
    TIMEOUT_S,
    RunningServer,
    openai,
    wait_until_healthy,
)


QUESTIONS = ["Hello there", "Tell me about Gaudi and flash attention", "2 + 2 =", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama_served"))


@pytest.fixture(scope="module")
def servers(checkpoint):
    """Continuous batching with the flag and without, and transformers' sequential generate() with the flag."""
    started = {}
    try:
        started["cb_flash"] = RunningServer(
            checkpoint, {"use_flash_attention": True}, continuous_batching=True, **CB_OPTIONS
        )
        started["cb_default"] = RunningServer(checkpoint, {}, continuous_batching=True, **CB_OPTIONS)
        started["flash"] = RunningServer(checkpoint, {"use_flash_attention": True})
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def expected_texts(checkpoint) -> dict[str, str]:
    """Each question's greedy answer from the model's own generate(), chat template applied as the server does."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = GaudiLlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    texts = {}
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        output = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        texts[question] = tokenizer.decode(output[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    return texts


@pytest.mark.parametrize("name", ["cb_flash", "cb_default", "flash"])
def test_greedy_answers_equal_generate_and_the_flag_picks_the_attention(name, servers, expected_texts, monkeypatch):
    server = servers[name]
    with count_attention_paths(monkeypatch, profile=False) as counts:
        answers = {question: server.chat(question) for question in QUESTIONS}
    assert answers == expected_texts
    assert any(answers.values())
    if name == "cb_default":
        assert counts["fused"] == 0 and counts["default"] > 0
    else:
        assert counts["default"] == 0 and counts["fused"] > 0


def test_a_request_of_the_sequential_path_may_set_the_flags_itself(servers, expected_texts, monkeypatch):
    server = servers["flash"]
    own_config = {"use_flash_attention": False, "max_new_tokens": MAX_TOKENS, "do_sample": False}
    with count_attention_paths(monkeypatch, profile=False) as counts:
        answer = server.chat(QUESTIONS[0], extra_body={"generation_config": json.dumps(own_config)})
    assert answer == expected_texts[QUESTIONS[0]]
    assert counts["fused"] == 0 and counts["default"] > 0


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(servers, expected_texts):
    server = servers["cb_flash"]
    answers: dict[str, str] = {}

    def ask(question: str) -> None:
        answers[question] = server.chat(question)

    threads = [threading.Thread(target=ask, args=(question,)) for question in QUESTIONS * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert answers == expected_texts


@pytest.mark.parametrize("name", ["cb_flash", "flash"])
def test_streamed_answer_equals_the_whole_answer(name, servers, expected_texts):
    server = servers[name]
    question = QUESTIONS[1]
    stream = server.client.chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len([piece for piece in pieces if piece]) > 1
    streamed, whole = "".join(pieces), expected_texts[question]
    # The random model ends on an incomplete UTF-8 character, which transformers' streamer holds back.
    assert whole.startswith(streamed) and set(whole[len(streamed) :]) <= {"\ufffd"}


def test_completions_and_responses_endpoints_answer_the_same_with_and_without_the_flag(servers):
    prompt = "The fused attention kernel"
    completions = {
        name: servers[name]
        .client.completions.create(model=servers[name].model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        .choices[0]
        .text
        for name in servers
    }
    assert completions["cb_flash"] == completions["cb_default"] == completions["flash"]
    responses = {
        name: servers[name]
        .client.responses.create(
            model=servers[name].model_id, input=prompt, max_output_tokens=MAX_TOKENS, temperature=0, stream=False
        )
        .output_text
        for name in ("cb_flash", "cb_default")
    }
    assert responses["cb_flash"] == responses["cb_default"] != ""


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 422, "json"),
        (
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "no_such_field": 1}).encode(),
            422,
            "no_such_field",
        ),
        (
            json.dumps({"model": "someone/else", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            404,
            "pinned",
        ),
    ],
    ids=["not-json", "unknown-field", "other-model"],
)
def test_malformed_request_gets_a_4xx_and_the_server_stays_up(body, status, words, servers, expected_texts):
    server = servers["cb_flash"]
    code, answer, _ = server.post("/v1/chat/completions", body)
    assert code == status, answer
    assert words in answer["error"]["message"].lower()
    assert server.chat(QUESTIONS[0]) == expected_texts[QUESTIONS[0]]


@pytest.mark.parametrize("name", ["cb_flash", "flash"])
def test_a_client_that_disconnects_mid_stream_leaves_the_server_serving(name, servers, expected_texts):
    server = servers[name]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {
        "model": server.model_id,
        "messages": [{"role": "user", "content": QUESTIONS[1]}],
        "max_tokens": 80,  # within the tiny model's 128 positions
        "stream": True,
    }
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    connection.close()  # gone after the first chunk
    assert server.chat(QUESTIONS[2]) == expected_texts[QUESTIONS[2]]


# ---------------------------------------------------------------------------------------------------------------
# The command line


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--attn-implementation", "flash_attention_2"], ["--attn-implementation 'flash_attention_2'", "gaudi"]),
        (["--attn-implementation", "eager", "--use_flash_attention"], ["contradicts", "eager"]),
        (["--flash_attention_recompute"], ["flash_attention_recompute", "requires `use_flash_attention`"]),
    ],
    ids=["not-a-gaudi-attention", "eager-with-flag", "companion-without-flag"],
)
def test_bad_attention_options_are_refused_before_loading(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve_main(argv)
    assert exit_info.value.code == 2
    message = " ".join(re.sub("[│╭╮╰╯─]", " ", capsys.readouterr().err).split())  # typer draws a box around it
    for word in words:
        assert word in message


def test_a_model_without_a_gaudi_class_is_refused_in_one_line(tmp_path, capsys):
    config = StableLmConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=300)
    StableLmForCausalLM(config).save_pretrained(tmp_path)
    train_tiny_tokenizer(chat_template=True).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        serve_main([str(tmp_path), "--port", str(free_port())])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "optimum.habana serve" not in error and "'stablelm'" in error and "StableLmDecoderLayer.forward" in error
    assert "Traceback" not in error


def test_an_option_transformers_serve_does_not_have_is_refused():
    with pytest.raises(TypeError, match="no_such_option"):
        GaudiServe(no_such_option=1)


def test_the_documented_command_serves_with_the_flag_and_sigterm_ends_it_in_seconds(long_checkpoint, tmp_path):
    """SIGTERM during a stream that would run for minutes: the stream ends with an error event and `[DONE]`, and
    the process exits (within the bound of `communicate`, well below the stream's length)."""
    port = free_port()
    env = {**os.environ, CACHE_ENV_VAR: str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "optimum.habana.serve",
        str(long_checkpoint),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    command += ["--continuous-batching", "--use_flash_attention"]
    command += [f"--{name.replace('_', '-')}={value}" for name, value in LONG_CB_CACHE.items()]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", process=process)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(
            model=str(long_checkpoint), messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0
        )
        assert answer.choices[0].finish_reason == "length" and answer.model == str(long_checkpoint)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": CB_ENDLESS, "stream": True}
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.readline().startswith(b"data: ")
    finally:
        process.terminate()
        events = [event for event in response.read().decode().split("\n\n") if event]
        _, stderr = process.communicate(timeout=30)
    assert events[-1] == "data: [DONE]" and '"code": "server_shutting_down"' in events[-2]
    assert "the fused kernel (use_flash_attention)" in stderr
    assert "Traceback" not in stderr
