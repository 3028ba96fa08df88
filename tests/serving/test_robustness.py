"""No request can hold the server: a client that disconnects cancels its generation, shutting down cancels every
request in flight (each gets its error), two requests cannot share an id, and a continuous-batching worker that
died is replaced. The model has 200k positions and no end-of-sequence token, so that a generation that is not
stopped would run for minutes: each check waits for its outcome with a bound well below that.
"""

import threading
import time
import urllib.error
import urllib.request

import pytest
from transformers import AutoTokenizer
from transformers.cli.serving.utils import CBWorkerDeadError

from optimum.habana.cli.serving.app import SHUTDOWN_GRACE_S
from optimum.habana.cli.serving.checks import RequestError
from optimum.habana.cli.serving.generation import GaudiCBGenerateManager
from optimum.habana.transformers import GaudiLlamaForCausalLM
from tests.helpers import save_tiny_checkpoint, tiny_config
from tests.serving.servers import CB_ENDLESS, ENDLESS, LONG_CB_CACHE, TIMEOUT_S, RunningServer


CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello there"}]
LENGTH = {"sequential": ENDLESS, "cb": CB_ENDLESS}
FLASH_CB_CACHE = {"cb_block_size": 16, "cb_num_blocks": 16, "cb_max_batch_tokens": 64}


def start(name: str, checkpoint) -> RunningServer:
    return RunningServer(checkpoint, **({"continuous_batching": True, **LONG_CB_CACHE} if name == "cb" else {}))


@pytest.fixture(scope="module")
def servers(long_checkpoint):
    started = {}
    try:
        for name in ("sequential", "cb"):
            started[name] = start(name, long_checkpoint)
        yield started
    finally:
        for running in started.values():
            running.stop()


def idle(server: RunningServer) -> bool:
    """Nothing generating: no request in flight, and with continuous batching nothing left in the scheduler."""
    manager = server.serve._generation_state._cb_manager
    processor = getattr(getattr(manager, "_cb", None), "batch_processor", None)
    return server.in_flight() == 0 and (processor is None or not processor.scheduler.has_pending_requests())


def wait_idle(server: RunningServer) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not idle(server):
        assert time.monotonic() < deadline, "a cancelled generation is still running"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("name", ["sequential", "cb"])
def test_a_client_that_disconnects_cancels_its_generation(name, stream, servers):
    server = servers[name]
    connection, response = (
        server.open_stream(CHAT, {"messages": HELLO, "max_tokens": LENGTH[name], "stream": True})
        if stream
        else (server.open_request(CHAT, {"messages": HELLO, "max_tokens": LENGTH[name]}), None)
    )
    if response is not None:
        assert response.readline().startswith(b"data: ")  # generating
    server.wait_in_flight(1)
    connection.close()
    wait_idle(server)
    status, answer, _ = server.post(CHAT, {"messages": HELLO, "max_tokens": 3})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("name", ["sequential", "cb"])
def test_shutting_down_cancels_the_requests_in_flight_each_with_its_error(name, long_checkpoint):
    server = start(name, long_checkpoint)
    outcome = {}

    def whole() -> None:
        outcome["whole"] = server.post(CHAT, {"messages": HELLO, "max_tokens": LENGTH[name]})

    asking = threading.Thread(target=whole)
    body = {"messages": HELLO, "max_tokens": LENGTH[name], "stream": True}
    connection, response = server.open_stream(CHAT, body)
    asking.start()
    try:
        server.wait_in_flight(2)
        assert response.readline().startswith(b"data: ")
    finally:
        server.stop()
    asking.join(TIMEOUT_S)
    events = [event for event in response.read().decode().split("\n\n") if event]
    connection.close()
    assert events[-1] == "data: [DONE]" and '"code": "server_shutting_down"' in events[-2]
    status, answer, _ = outcome["whole"]
    assert status == 503 and answer["error"]["code"] == "server_shutting_down"


def test_a_request_still_being_prepared_when_the_server_shuts_down_gets_its_503_at_once(long_checkpoint):
    """Handed the engine's manager, then shut down under it before it starts generating: a 503 at once (it waited
    for the stopped engine's cache until uvicorn gave up: a 500), and a request that asks for a manager or the model
    afterwards starts or loads nothing."""
    server = start("cb", long_checkpoint)  # its engine runs from the start
    state = server.serve._generation_state
    handed, shut_down = threading.Event(), threading.Event()
    get_manager, shutdown = state.get_manager, state.shutdown

    def get_manager_then_wait(model_id: str, use_cb: bool = False):
        manager = get_manager(model_id, use_cb=use_cb)
        handed.set()
        shut_down.wait(TIMEOUT_S)
        return manager

    def shutdown_then_say_so() -> None:
        shutdown()
        shut_down.set()

    state.get_manager, state.shutdown = get_manager_then_wait, shutdown_then_say_so
    outcome = {}
    asking = threading.Thread(target=lambda: outcome.update(whole=server.post(CHAT, {"messages": HELLO})))
    asking.start()
    try:
        assert handed.wait(TIMEOUT_S)
        stopped_at = time.monotonic()
    finally:
        server.stop()
    asking.join(TIMEOUT_S)
    status, answer, _ = outcome["whole"]
    assert status == 503 and answer["error"]["code"] == "server_shutting_down", answer
    assert time.monotonic() - stopped_at < SHUTDOWN_GRACE_S
    with pytest.raises(RequestError, match="shutting down"):
        get_manager(server.serve._model_manager.served.name, use_cb=True)
    assert state._cb_manager is None
    with pytest.raises(RequestError, match="shutting down"):
        server.serve._model_manager.load_model_and_processor(f"{long_checkpoint}@main")
    assert not server.serve._model_manager.loaded_models


def test_two_requests_in_flight_cannot_share_an_id(servers):
    server = servers["sequential"]
    same = {"x-request-id": "one-id"}
    connection, response = server.open_stream(
        CHAT, {"messages": HELLO, "max_tokens": ENDLESS, "stream": True}, headers=same
    )
    assert response.readline().startswith(b"data: ")
    status, answer, _ = server.post(CHAT, {"messages": HELLO, "max_tokens": 2}, headers=same)
    assert status == 409 and answer["error"]["param"] == "x-request-id"
    connection.close()
    wait_idle(server)
    status, _, headers = server.post(CHAT, {"messages": HELLO, "max_tokens": 2}, headers=same)
    assert status == 200 and headers["x-request-id"] == "one-id"


def health(server: RunningServer) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"{server.base_url}/health", timeout=TIMEOUT_S) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_a_dead_continuous_batching_worker_is_replaced(servers, monkeypatch):
    """The engine dies: /health says so; a replacement that cannot start is a 503 with the reason (a 500 before),
    one that can serves again."""
    server = servers["cb"]
    assert server.post(CHAT, {"messages": HELLO, "max_tokens": 2})[0] == 200
    worker = server.serve._generation_state._cb_manager._cb
    worker.background_thread_status.fatal_error = RuntimeError("a crash of the worker")  # as its loop records one
    assert health(server)[0] == 503
    monkeypatch.setattr(server.serve._generation_state._cb_config, "num_blocks", 10**11)  # no memory holds it
    for _ in range(2):
        status, answer, _ = server.post(CHAT, {"messages": HELLO, "max_tokens": 2})
        assert status == 503 and answer["error"]["code"] == "worker_dead", answer
        assert "could not start: its paged KV cache could not be built (MemoryError" in answer["error"]["message"]
        assert health(server)[0] == 503
    monkeypatch.undo()
    status, answer, _ = server.post(CHAT, {"messages": HELLO, "max_tokens": 2})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2
    assert health(server)[0] == 200


def test_a_manager_whose_engine_was_stopped_starts_none():
    """Replaced after its worker died, a manager still held by a request being prepared: that request gets the
    worker's 503 at once, and no second engine starts behind the replacement."""
    manager = GaudiCBGenerateManager()
    manager.stop()
    with pytest.raises(CBWorkerDeadError, match="has stopped"):
        manager.init_cb(GaudiLlamaForCausalLM(tiny_config("llama")))
    assert manager._cb is None


@pytest.fixture(scope="module")
def flash_cb_server(tmp_path_factory):
    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama_flash_cb"))
    server = RunningServer(checkpoint, flags={"use_flash_attention": True}, continuous_batching=True, **FLASH_CB_CACHE)
    yield server
    server.stop()


def test_a_one_token_prompt_is_served_with_the_flag_in_continuous_batching(flash_cb_server):
    """A one-token prompt in the engine's first step (nothing cached) was a 500 that emptied its whole batch."""
    tokenizer = AutoTokenizer.from_pretrained(flash_cb_server.model_id)
    assert len(tokenizer("0")["input_ids"]) == 1
    for _ in range(2):  # the engine's first step, then a step of a running engine
        status, answer, _ = flash_cb_server.post("/v1/completions", {"prompt": "0", "max_tokens": 3})
        assert status == 200 and answer["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}


def test_an_engine_step_that_fails_fails_its_request_and_the_next_ones_are_served(flash_cb_server, monkeypatch):
    """transformers' engine died on any exception in a step (every later request a 503 until a new worker started);
    a stand-in failure in the forward fails its request only, and the engine goes on."""
    forward = GaudiLlamaForCausalLM.forward
    armed = threading.Event()

    def fails_once(self, *args, **kwargs):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("a failure inside the engine's step")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GaudiLlamaForCausalLM, "forward", fails_once)
    assert flash_cb_server.post(CHAT, {"messages": HELLO, "max_tokens": 2})[0] == 200
    worker = flash_cb_server.serve._generation_state._cb_manager._cb
    armed.set()
    status, answer, _ = flash_cb_server.post(CHAT, {"messages": HELLO, "max_tokens": 2})
    assert status == 500 and "a failure inside the engine's step" in answer["error"]["message"], answer
    for _ in range(2):
        status, answer, _ = flash_cb_server.post(CHAT, {"messages": HELLO, "max_tokens": 2})
        assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
    assert health(flash_cb_server)[0] == 200
    assert flash_cb_server.serve._generation_state._cb_manager._cb is worker  # the same engine, never restarted


MARKER = "@"  # a character of the marked prompt only: the stand-in below fails every step that holds its token


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_that_fails_in_a_shared_step_fails_alone(flash_cb_server, stream, monkeypatch):
    """A request that fails inside an engine step it shares with two others (a stand-in: the forward raises on any
    step holding the marked prompt's token): it gets its error (a 500 naming the failure, or a stream's error event
    and `[DONE]`), the two others their text as when each ran alone, and the next request is served by the same
    engine. The three are queued while the engine is paused, so that they share its next steps."""
    server = flash_cb_server
    tokenizer = AutoTokenizer.from_pretrained(server.model_id)
    marker = tokenizer.convert_tokens_to_ids(MARKER)
    questions = [[{"role": "user", "content": text}] for text in ("Hello there", "The quick brown fox")]
    marked = [{"role": "user", "content": f"fail {MARKER}"}]
    alone = []
    for messages in questions:
        assert marker not in tokenizer.apply_chat_template(messages)["input_ids"]
        status, answer, _ = server.post(CHAT, {"messages": messages, "max_tokens": 6})
        assert status == 200 and MARKER not in answer["choices"][0]["message"]["content"], answer
        alone.append(answer["choices"][0]["message"]["content"])

    forward = GaudiLlamaForCausalLM.forward
    failed_steps = []

    def fails_on_marker(self, *args, **kwargs):
        input_ids = kwargs["input_ids"]
        if (input_ids == marker).any():
            failed_steps.append(input_ids.shape[-1])
            raise RuntimeError("a stand-in failure of the marked request")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GaudiLlamaForCausalLM, "forward", fails_on_marker)
    worker = server.serve._generation_state._cb_manager._cb
    outcomes: dict[int, tuple] = {}

    def ask(index: int, messages: list[dict]) -> None:
        outcomes[index] = server.post(CHAT, {"messages": messages, "max_tokens": 6})

    def ask_streaming() -> None:
        connection, response = server.open_stream(CHAT, {"messages": marked, "max_tokens": 6, "stream": True})
        outcomes[2] = (response.status, [event for event in response.read().decode().split("\n\n") if event])
        connection.close()

    askers = [threading.Thread(target=ask, args=(index, messages)) for index, messages in enumerate(questions)]
    askers.append(threading.Thread(target=ask_streaming) if stream else threading.Thread(target=ask, args=(2, marked)))
    with worker.pause():
        for asker in askers:
            asker.start()
        deadline = time.monotonic() + TIMEOUT_S
        while worker.input_queue.qsize() < 3:
            assert time.monotonic() < deadline, "the requests never reached the engine"
            time.sleep(0.02)
    for asker in askers:
        asker.join(TIMEOUT_S)
    assert not any(asker.is_alive() for asker in askers), "a request is still waiting"

    assert failed_steps and max(failed_steps) > len(tokenizer.apply_chat_template(marked)["input_ids"])  # shared
    if stream:
        status, events = outcomes[2]
        assert status == 200 and events[-1] == "data: [DONE]", events
        assert "a stand-in failure of the marked request" in events[-2], events
    else:
        status, answer, _ = outcomes[2]
        assert status == 500 and "a stand-in failure of the marked request" in answer["error"]["message"], answer
    for index, text in enumerate(alone):
        status, answer, _ = outcomes[index]
        assert status == 200 and answer["choices"][0]["message"]["content"] == text, answer
    status, answer, _ = server.post(CHAT, {"messages": HELLO, "max_tokens": 2})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
    assert health(server)[0] == 200 and server.serve._generation_state._cb_manager._cb is worker
