"""Servers for the serving tests: transformers' server on the Gaudi classes, in this process (uvicorn in a thread,
as transformers' own serving tests run it) on 127.0.0.1, and plain HTTP helpers with bounded timeouts."""

import http.client
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import tiny_config, train_tiny_tokenizer


openai = pytest.importorskip("openai", reason="the serving extra is not installed")
from optimum.habana.cli.serving.server import GaudiServe  # noqa: E402


MAX_TOKENS = 10
TIMEOUT_S = 60  # every HTTP call's bound
# A small paged cache: transformers sizes it from the free memory otherwise, seconds of allocation here.
CB_OPTIONS = {"cb_block_size": 16, "cb_num_blocks": 64, "cb_max_batch_tokens": 128}
# Generations of the long-context model that would run for minutes unless something stops them: sequential, and
# with continuous batching in a paged cache of LONG_CB_CACHE (minutes here too; a larger cache starts slowly).
ENDLESS = 150_000
CB_ENDLESS = 30_000
LONG_CB_CACHE = {"cb_block_size": 16, "cb_num_blocks": 2000, "cb_max_batch_tokens": 64}  # 32000 tokens


def listening_port(server, timeout_s: float = 120) -> int:
    """The port a uvicorn server started with port 0 listens on, once it listens."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.started:
            return server.servers[0].sockets[0].getsockname()[1]
        if server.should_exit:
            raise AssertionError("the server stopped before it listened")
        time.sleep(0.05)
    raise AssertionError(f"the server did not listen within {timeout_s} s")


def wait_until_healthy(base_url: str, timeout_s: float = 120, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}: {process.stderr.read()}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"no healthy server at {base_url} after {timeout_s} s")


def save_checkpoint(folder: Path, positions: int, **config) -> Path:
    """A tiny Llama of `positions` positions with a chat tokenizer beside it."""
    tokenizer = train_tiny_tokenizer(chat_template=True)
    torch.manual_seed(0)
    model_config = tiny_config("llama", vocab_size=len(tokenizer), max_position_embeddings=positions, **config)
    AutoModelForCausalLM.from_config(model_config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_long_context_checkpoint(folder: Path) -> Path:
    """A tiny Llama with 200k positions and no end-of-sequence token: its generations end when they are stopped."""
    return save_checkpoint(folder, 200_000, eos_token_id=None)


class RunningServer:
    def __init__(self, checkpoint: Path, flags: dict[str, bool] | None = None, **options):
        # Port 0: uvicorn binds a port the kernel picks at that moment, so no other process (a parallel test's
        # connection) can take it between a probe and the bind, as it can with `free_port()`.
        self.serve = GaudiServe(
            attention_flags=flags or {},
            force_model=str(checkpoint),
            device="cpu",
            host="127.0.0.1",
            port=0,
            non_blocking=True,
            **options,
        )
        self.port = listening_port(self.serve.server)
        self.base_url = f"http://127.0.0.1:{self.port}"
        wait_until_healthy(self.base_url)
        self.model_id = str(checkpoint)
        self.client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)

    def chat(self, question: str, **kwargs) -> str:
        answer = self.client.chat.completions.create(
            model=self.model_id,
            messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            **kwargs,
        )
        return answer.choices[0].message.content

    def post(self, path: str, body: bytes | dict, timeout: float = TIMEOUT_S, headers: dict | None = None):
        """(status, parsed JSON or text, response headers) of a POST."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.base_url}{path}",
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, text, response_headers = response.status, response.read().decode(), response.headers
        except urllib.error.HTTPError as error:
            status, text, response_headers = error.code, error.read().decode(), error.headers
        try:
            return status, json.loads(text), response_headers
        except json.JSONDecodeError:
            return status, text, response_headers

    def open_stream(
        self, path: str, body: dict, headers: dict | None = None
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
        return connection, connection.getresponse()

    def open_request(self, path: str, body: dict, headers: dict | None = None) -> http.client.HTTPConnection:
        """A request sent, its answer not read: the connection, to close as a client that gives up does."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
        return connection

    def in_flight(self) -> int:
        return len(self.serve._requests._open)

    def wait_in_flight(self, count: int) -> None:
        """Until `count` requests are in flight (bounded)."""
        deadline = time.monotonic() + TIMEOUT_S
        while self.in_flight() != count:
            assert time.monotonic() < deadline, f"{self.in_flight()} requests in flight, not {count}"
            time.sleep(0.02)

    def stop(self) -> None:
        self.serve.kill_server()


def sequential_and_continuous_batching(checkpoint: Path, **cb_options) -> Iterator[dict[str, RunningServer]]:
    """A plain server and a continuous-batching one on the same checkpoint, for a module-scoped fixture to `yield
    from`; both are stopped however the tests end."""
    started = {}
    try:
        started["sequential"] = RunningServer(checkpoint)
        started["cb"] = RunningServer(checkpoint, continuous_batching=True, **cb_options)
        yield started
    finally:
        for running in started.values():
            running.stop()
