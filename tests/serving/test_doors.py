"""Who may use the server: `--api-key` (every route but /health needs it), the administration routes (off unless
asked for, and pinned to the served model), the start-up lines that say so; and the continuous-batching cache
sized to the served model on CPU, with its start-up line."""

import logging
import math
import urllib.error
import urllib.request

import pytest

from optimum.habana.cli.serving import cache
from tests.helpers import save_tiny_checkpoint
from tests.serving.servers import TIMEOUT_S, RunningServer, openai


KEY = "s3cret-key"
CHAT = "/v1/chat/completions"
HELLO = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama_doors"))


@pytest.fixture(scope="module")
def keyed(checkpoint):
    server = RunningServer(checkpoint, api_key=KEY)
    yield server
    server.stop()


def get(server: RunningServer, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{server.base_url}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.parametrize(
    "headers, words",
    [
        ({}, "No API key was given"),
        ({"Authorization": "Bearer wrong"}, "The API key given is not this server's"),
        ({"Authorization": KEY}, "does not start with the Bearer scheme"),
        ({"Authorization": f"Basic {KEY}"}, "does not start with the Bearer scheme"),
        ({"Authorization": "Bearer"}, "No API key was given after Bearer"),
    ],
)
def test_without_the_key_every_route_but_health_is_a_401(keyed, headers, words):
    status, answer, response_headers = keyed.post(CHAT, HELLO, headers=headers)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key", answer
    assert words in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error" and "Authorization: Bearer" in answer["error"]["message"]
    assert response_headers["WWW-Authenticate"] == "Bearer"
    for path in ("/v1/models", "/openapi.json", "/docs"):
        assert get(keyed, path, headers)[0] == 401
    assert keyed.post("/reset", {}, headers=headers)[0] == 401  # not even told whether it exists
    assert get(keyed, "/health", headers)[0] == 200
    assert keyed.in_flight() == 0  # refused before anything was opened


def test_with_the_key_the_server_answers(keyed):
    status, answer, _ = keyed.post(CHAT, HELLO, headers=BEARER)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2
    for scheme in ("bearer", "BEARER"):  # HTTP's schemes are case-insensitive
        assert keyed.post(CHAT, HELLO, headers={"Authorization": f"{scheme} {KEY}"})[0] == 200
    assert get(keyed, "/openapi.json", BEARER)[0] == 200
    client = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
    assert [model.id for model in client.models.list().data] == [keyed.model_id]
    with pytest.raises(openai.AuthenticationError):
        keyed.client.models.list()  # api_key "unused"


def test_the_start_up_lines_say_who_may_use_the_server(checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="optimum.habana.cli.serving.server"):
        RunningServer(checkpoint, api_key=KEY).stop()
        RunningServer(checkpoint, admin_routes=True).stop()
    assert "API key required: every route but /health answers 401" in caplog.text
    assert "No API key: any client that reaches 127.0.0.1:" in caplog.text
    assert "Admin routes on: /reset and /load_model answer anyone." in caplog.text


def test_admin_routes_are_off_by_default(keyed):
    for path in ("/reset", "/load_model", "/v1/systemone"):
        status, answer, _ = keyed.post(path, {"model": "x"}, headers=BEARER)
        assert status == 404 and "is not served here" in answer["error"]["message"], (path, answer)


def test_admin_routes_when_asked_are_pinned_to_the_served_model(checkpoint):
    server = RunningServer(checkpoint, admin_routes=True)
    try:
        status, answer, _ = server.post("/load_model", {"model": "someone/else"})
        assert status == 404 and answer["error"]["param"] == "model" and "pinned" in answer["error"]["message"]
        status, events, _ = server.post("/load_model", {"model": server.model_id})
        assert status == 200 and '"status": "ready"' in events.replace('":"', '": "')
        assert server.post("/reset", {})[0] == 200
        status, answer, _ = server.post(CHAT, HELLO)  # the pinned model loads again
        assert status == 200 and answer["model"] == server.model_id
    finally:
        server.stop()


def test_the_cpu_cache_holds_what_the_model_needs_and_the_options_override_it(checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="optimum.habana.cli.serving.server"):
        sized = RunningServer(checkpoint, continuous_batching=True)
        given = RunningServer(checkpoint, continuous_batching=True, cb_num_blocks=3, cb_block_size=16)
    try:
        blocks = math.ceil(cache.CPU_SEQUENCES * 128 / cache.DEFAULT_PAGE_SIZE)  # the tiny model's 128 positions
        processor = sized.serve._generation_state._cb_manager._cb.batch_processor
        assert processor.cache.num_blocks == blocks and processor.cache.max_batch_tokens == cache.CPU_BATCH_TOKENS
        assert given.serve._generation_state._cb_manager._cb.batch_processor.cache.num_blocks == 3
        assert f"a paged KV cache of {blocks} blocks of 256 tokens ({blocks * 256} tokens, " in caplog.text
        assert "a paged KV cache of 3 blocks of 16 tokens (48 tokens, " in caplog.text
        assert sized.post(CHAT, HELLO)[0] == given.post(CHAT, HELLO)[0] == 200
    finally:
        sized.stop()
        given.stop()


def test_the_cpu_cache_stays_within_its_budget(checkpoint, monkeypatch):
    """A model whose 8 contexts would pass the budget gets the budget's worth of blocks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    per_block = cache.DEFAULT_PAGE_SIZE * cache.bytes_per_token(model)
    monkeypatch.setattr(cache, "CPU_CACHE_BUDGET_GIB", 10 * per_block / 1024**3)
    assert cache.sized_for_cpu({}, model, 200_000) == {"num_blocks": 10, "max_batch_tokens": cache.CPU_BATCH_TOKENS}
    assert cache.sized_for_cpu({"num_blocks": 7}, model, 200_000) == {"num_blocks": 7}
