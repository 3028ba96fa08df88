"""No request can stall the server (issue 36): while one client sends the worst bodies these cases build, `/health`
and an ordinary request from another client answer within 1 s, on the sequential and the continuous-batching
server, each worst body gets its 4xx, and memory is back where it was.

The model has SmolLM2's 8192 positions; its tiny vocabulary's longest token has 10 characters, so no prompt of more
than 81,920 characters fits, and the default body limit is 1 MiB + 6 bytes x 81,920.
"""

import json
import socket
import threading
import time
import urllib.request

import psutil
import pytest

from tests.serving.servers import TIMEOUT_S, RunningServer, save_checkpoint, sequential_and_continuous_batching


POSITIONS = 8192
LONGEST_TOKEN = 10  # the tiny vocabulary's (`preparation.longest_token`)
PROMPT_BOUND = POSITIONS * LONGEST_TOKEN
BODY_LIMIT = 1024**2 + 6 * PROMPT_BOUND
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]
LATENCY_BOUND_S = 1.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    checkpoint = save_checkpoint(tmp_path_factory.mktemp("tiny_llama_8192"), POSITIONS)
    yield from sequential_and_continuous_batching(
        checkpoint, cb_block_size=16, cb_num_blocks=64, cb_max_batch_tokens=128
    )


@pytest.fixture(params=["sequential", "cb"])
def server(request, servers):
    return servers[request.param]


def send_raw(
    server: RunningServer, body: bytes, declared: int | None = None, chunked: bool = False
) -> tuple[int, str]:
    """The status and body of a POST of `body` to the chat endpoint, sent raw: its headers with `Expect:
    100-continue` (as curl sends a large body) and `declared` as its length, its body once the server asks for it;
    or chunked, all of it (the server drops what passes its limit)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S) as connection:
        head = f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\n"
        answer = b""
        try:
            if chunked:
                connection.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
                for start in range(0, len(body), 1 << 16):
                    part = body[start : start + (1 << 16)]
                    connection.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                connection.sendall(b"0\r\n\r\n")
            else:
                length = declared or len(body)
                connection.sendall(f"{head}Content-Length: {length}\r\nExpect: 100-continue\r\n\r\n".encode())
                answer = connection.recv(1 << 16)
                if answer.startswith(b"HTTP/1.1 100") and declared is None:
                    answer = answer.partition(b"\r\n\r\n")[2]
                    connection.sendall(body)
        except OSError:  # the server answered and closed: what it read is all it reads
            pass
        while chunk := connection.recv(1 << 16):
            answer += chunk
    head, _, text = answer.decode().partition("\r\n\r\n")
    return int(head.split(" ", 2)[1]), text


def chat_body(content: str, **fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], **fields}).encode()


# Each worst body, how it is sent, and its status.
WORST = {
    "50-MB-declared": (b"", 50_000_000, False, 413),
    "50-MB-chunked": (b"x" * 50_000_000, None, True, 413),
    "2048-messages-of-6000-characters": (json.dumps({"messages": [{"role": "user", "content": "w " * 3000}] * 2048}).encode(), None, False, 413),
    "4-stop-strings-of-1-MB": (chat_body("hi", stop=["s" * 1_000_000] * 4), None, False, 413),
    "just-under-the-body-limit": (chat_body("hello " * ((BODY_LIMIT - 200) // 6)), None, False, 400),
    "just-under-the-prompt-bound": (chat_body("hello " * (PROMPT_BOUND // 6 - 10)), None, False, 400),
    "4-stop-strings-of-65-characters": (chat_body("hi", stop=["s" * 65] * 4), None, False, 400),
    "nested-50000-deep": (b"[" * 50_000 + b"]" * 50_000, None, False, 400),
    "a-5000-digit-number": (b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}", None, False, 400),
}  # fmt: skip


def worst_round(server: RunningServer) -> dict[str, int]:
    return {name: send_raw(server, body, declared, chunked)[0] for name, (body, declared, chunked, _) in WORST.items()}


def resident_mib() -> float:
    return psutil.Process().memory_info().rss / 1024**2


def test_the_worst_bodies_stall_no_one(server):
    """One client sends every worst body twice; meanwhile another asks /health and an ordinary chat, again and
    again: each answers within 1 s."""
    statuses = worst_round(server)  # warm: what a first request allocates once
    assert statuses == {name: case[3] for name, case in WORST.items()}
    before = resident_mib()
    latencies: dict[str, list[float]] = {"health": [], "chat": []}
    done = threading.Event()

    def ordinary_client() -> None:
        while not done.is_set():
            start = time.monotonic()
            with urllib.request.urlopen(f"{server.base_url}/health", timeout=TIMEOUT_S) as health:
                assert health.status == 200
            latencies["health"].append(time.monotonic() - start)
            start = time.monotonic()
            status, answer, _ = server.post(CHAT, {"messages": HELLO, "max_tokens": 2, "temperature": 0})
            assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
            latencies["chat"].append(time.monotonic() - start)

    other = threading.Thread(target=ordinary_client)
    other.start()
    try:
        assert worst_round(server) == statuses
    finally:
        done.set()
        other.join(TIMEOUT_S)
    assert len(latencies["chat"]) >= 3
    assert max(latencies["health"]) < LATENCY_BOUND_S and max(latencies["chat"]) < LATENCY_BOUND_S, latencies
    time.sleep(0.5)  # the memory of the refused requests goes back after their answer, off the loop
    assert resident_mib() < before + 64
    assert server.in_flight() == 0


def test_templating_runs_off_the_event_loop(server, monkeypatch):
    """A chat template that takes 2 s holds its own request only: /health and a completion (no template) answer."""
    _, processor = server.serve._model_manager.load_model_and_processor(
        server.serve._model_manager.process_model_name(server.model_id)
    )
    slow_template = processor.apply_chat_template

    def apply_chat_template(*args, **kwargs):
        time.sleep(2)
        return slow_template(*args, **kwargs)

    monkeypatch.setattr(processor, "apply_chat_template", apply_chat_template)
    answers = {}
    slow = threading.Thread(
        target=lambda: answers.update(slow=server.post(CHAT, {"messages": HELLO, "max_tokens": 2}))
    )
    slow.start()
    server.wait_in_flight(1)
    start = time.monotonic()
    with urllib.request.urlopen(f"{server.base_url}/health", timeout=TIMEOUT_S) as health:
        assert health.status == 200
    status, answer, _ = server.post(COMPLETIONS, {"prompt": "Hello", "max_tokens": 2})
    assert status == 200 and time.monotonic() - start < LATENCY_BOUND_S, answer
    assert slow.is_alive()  # still templating
    slow.join(TIMEOUT_S)
    assert answers["slow"][0] == 200


def test_a_prompt_that_cannot_fit_is_refused_by_its_length_before_tokenizing(server, monkeypatch):
    _, processor = server.serve._model_manager.load_model_and_processor(
        server.serve._model_manager.process_model_name(server.model_id)
    )

    def no_template(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(processor, "apply_chat_template", no_template)
    content = "x" * (PROMPT_BOUND + 1)
    status, answer, _ = server.post(CHAT, {"messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert answer["error"]["param"] == "messages"
    assert (
        f"no token of its vocabulary stands for more than {LONGEST_TOKEN} characters, so a prompt of more than "
        f"{PROMPT_BOUND} characters cannot fit. However, your messages hold {PROMPT_BOUND + 1} characters"
    ) in answer["error"]["message"]


def test_a_body_above_the_limit_is_a_413_naming_the_limit(server):
    for declared in (None, BODY_LIMIT + 1):  # read until it passed the limit; refused by its declared length
        status, text = send_raw(server, b"{" + b" " * BODY_LIMIT + b"}", declared=declared, chunked=declared is None)
        answer = json.loads(text)
        assert status == 413 and answer["error"]["code"] == "request_too_large", answer
        assert f"({BODY_LIMIT} bytes, --max-body-bytes;" in answer["error"]["message"]
    assert server.in_flight() == 0
