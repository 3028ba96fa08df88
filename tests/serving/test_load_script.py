"""examples/serving/load_test.py, shrunk to a few seconds: it starts the server, mixes good, streamed, abandoned,
bad and hostile requests, measures, sends SIGTERM, and reports every criterion met (no timed assertion: the numbers
are the script's output, documented in docs/serving.md); and values that cannot make a test are refused."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script, save_tiny_checkpoint


SCRIPT = Path(__file__).parents[2] / "examples" / "serving" / "load_test.py"


def test_the_load_test_runs_and_its_criteria_hold(tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    report_path = tmp_path / "load.json"
    command = [sys.executable, str(SCRIPT), "--model", str(checkpoint), "--clients", "7", "--duration", "2"]
    command += ["--warmup", "2", "--continuous-batching", "--output", str(report_path)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    report = json.loads(report_path.read_text())
    assert report["failed"] == [] and report["server_errors"] == report["hung"] == report["good_incomplete"] == 0
    assert report["kinds"].keys() == {"chat", "stream", "completion", "response", "abandon", "bad", "hostile"}
    assert report["statuses"]["200"] > 0 and report["hostile_not_4xx"] == {} and report["good_refused"] == 0
    assert report["health_max_latency_s"] < 1
    assert report["sigterm_streams_ended"] and (tmp_path / "load.server.log").exists()


@pytest.fixture(scope="module")
def load_test():
    return load_script("examples/serving/load_test.py")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--warmup", "-1"], "--warmup must be 0 or more requests, got -1"),
        (["--duration", "nan"], "--duration must be a positive number, got nan"),
        (["--duration", "0"], "--duration must be a positive number, got 0.0"),
        (["--request-timeout", "inf"], "--request-timeout must be a positive number, got inf"),
        (["--output", "/no/such/folder/load.json"], "the folder /no/such/folder does not exist"),
        (["--output", __file__], "exists: add --overwrite to replace it"),
        (["--clients", str(10**7)], "needs as many connections, and this process may open"),
    ],
)
def test_values_that_cannot_make_a_test_are_refused(load_test, argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_test.parse_args(argv)
    assert exit_info.value.code == 2 and words in capsys.readouterr().err


def test_it_says_when_every_good_request_was_refused_and_why(load_test, monkeypatch, capsys):
    """As with --max-tokens beyond the model's context: each good request a 400 (the server's words are kept)."""
    why = "400: This model's maximum context length is 128 tokens. However, you requested 1010 tokens"
    report = {
        "kinds": {"chat": 3, "stream": 2, "bad": 1}, "good_refused": 5, "good_refused_because": {why: 5},
        "server_errors": 0, "hung": 0, "client_errors": 0, "good_incomplete": 5, "bad_not_4xx": 0,
        "hostile_not_4xx": {}, "health_max_latency_s": 0.01, "rss_growth": 0.0, "sigterm_drain_s": 0.5,
        "sigterm_streams_ended": True,
    }  # fmt: skip

    async def run(args):
        return dict(report)

    monkeypatch.setattr(load_test, "run", run)
    assert load_test.main(["--max-tokens", "1000"]) == 1
    assert f"load_test.py: every good request was refused: 5 x {why}" in capsys.readouterr().err
    report["kinds"] = {"bad": 1}  # nothing good was sent: a run that tests nothing fails
    assert load_test.main([]) == 1
    assert "no good request was sent" in capsys.readouterr().out


# Stand-ins for the server, started as it is (a process, its stderr in the log): one that finds its port taken, and
# one that answers /health. Plain Python, no model: what is tested is the load test's start-up.
PORT_TAKEN = (
    "import sys; sys.stderr.write('optimum.habana.serve: --port {port} is in use on 127.0.0.1: stop what listens "
    "there or take another port.\\n'); sys.exit(2)"
)
HEALTHY = """
import http.server

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", {port}), Health).serve_forever()
"""


@pytest.mark.parametrize("taken", [1, 3])
def test_a_port_taken_before_the_server_binds_it_is_replaced(load_test, taken, tmp_path, monkeypatch):
    """The port is probed free, then bound by the server: a process between the two (a parallel test's connection)
    makes the server exit; the load test starts it on another port, up to PORT_ATTEMPTS times, then says why."""
    started = []

    def start_server(args, port, log):
        started.append(port)
        code = PORT_TAKEN if len(started) <= taken else HEALTHY
        return subprocess.Popen([sys.executable, "-c", code.format(port=port)], stderr=log.open("w"))

    async def start():
        async with load_test.aiohttp.ClientSession() as session:
            return await load_test.start_healthy_server(session, None, tmp_path / "server.log")

    monkeypatch.setattr(load_test, "start_server", start_server)
    if taken >= load_test.PORT_ATTEMPTS:
        with pytest.raises(load_test.PortTaken) as refusal:
            asyncio.run(start())
        assert len(started) == load_test.PORT_ATTEMPTS
        assert (
            f"exited with 2 before it served; its last line: optimum.habana.serve: --port {started[-1]} is in use"
            in str(refusal.value)
        )
        return
    server, address = asyncio.run(start())
    try:
        assert len(started) == taken + 1 and address == f"http://127.0.0.1:{started[-1]}"
    finally:
        load_test.stop_server(server)
    assert server.poll() is not None


REFUSING = HEALTHY.replace(
    "    def log_message",
    """    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{{"error": {{"message": "max_tokens 100000 exceeds the model\\'s context of 8192 tokens"}}}}'
        self.send_response(400)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message""",
)


def test_settings_the_server_refuses_stop_the_test_before_its_run_with_the_reason(
    load_test, tmp_path, monkeypatch, capsys
):
    """--max-tokens past the model's context: the first good request is refused, and the load test says so in one
    line with the server's reason, exit 2 (a KeyError 'why' from the abandoned streams' refusals before)."""
    monkeypatch.setattr(
        load_test,
        "start_server",
        lambda args, port, log: subprocess.Popen(
            [sys.executable, "-c", REFUSING.format(port=port)], stderr=log.open("w")
        ),
    )
    monkeypatch.chdir(tmp_path)
    assert load_test.main(["--max-tokens", "100000", "--clients", "2", "--duration", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "load_test.py: error: the server refuses a good request with --max-tokens 100000 (400: max_tokens 100000 "
        "exceeds the model's context of 8192 tokens): lower --max-tokens"
    ]
