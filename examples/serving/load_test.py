#!/usr/bin/env python
"""A bounded load test of `python -m optimum.habana.serve`: many clients, good and bad requests, cancellations.

    python examples/serving/load_test.py --clients 64 --duration 60 --continuous-batching --output load.json

Starts the server (MODEL: `--model`, else its embedded default) on 127.0.0.1 as a subprocess, warms it up, then
runs `--clients` asyncio clients for `--duration` seconds. Each client loops over a mix: chat completions whole
and streamed, completions, responses, streams it abandons after the first chunk (the client disconnects), and bad
requests (each must be a 4xx). Every request has a bound (`--request-timeout`): one that passes it is counted as
hanging. Then the server gets SIGTERM with streams in flight and must exit within `--drain-limit` seconds.

It reports requests per second, p50 and p99 latency of the good requests, the server's resident memory after
warm-up and after the run, and the drain time; it exits 1 when a criterion fails: a 5xx, a request left hanging,
a good request that did not complete (a stream without its end), a bad request answered 2xx, resident memory
after the run more than 10% above after warm-up, or a drain slower than the limit. It only talks to the
loopback address, and stops by itself.
"""

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import psutil


PROG = "load_test.py"
HELLO = "Tell me about the fused attention kernel."
# Bad requests: each must be a 4xx (never a 5xx, never a 2xx).
BAD = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 10**400}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "caf\ud800e"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"²": 1}}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "generation_config": "{x"}),
    ("/v1/completions", {"prompt": ["a", "b"]}),
    ("/v1/responses", {"input": "hi", "text": {"format": "json"}}),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]}),
    ("/v1/audio/transcriptions", {}),
]
KINDS = {"chat": 30, "stream": 25, "completion": 10, "response": 10, "abandon": 10, "bad": 15}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a checkpoint folder or hub id (default: the server's embedded model)")
    parser.add_argument("--continuous-batching", action="store_true", help="serve with continuous batching")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--duration", type=float, default=60, help="seconds of load (default 60)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per good request (default 16)")
    parser.add_argument("--warmup", type=int, default=8, help="requests before the measured run (default 8)")
    parser.add_argument("--request-timeout", type=float, default=300, help="a request's bound in seconds")
    parser.add_argument("--drain-limit", type=float, default=10, help="seconds SIGTERM may take (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="the mix's random seed")
    parser.add_argument("--output", type=Path, help="write the report as JSON there")
    args = parser.parse_args(argv)
    for name in ("clients", "duration", "max_tokens", "request_timeout", "drain_limit"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "optimum.habana.serve", *([args.model] if args.model else [])]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--continuous-batching"] if args.continuous_batching else []
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))}
    env.pop("OPTIMUM_HABANA_API_KEY", None)
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"), env=env)


async def wait_healthy(session: aiohttp.ClientSession, base: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before it served")
        try:
            async with session.get(f"{base}/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError("the server did not answer /health within 600 s")


def good_request(kind: str, max_tokens: int) -> tuple[str, dict]:
    messages = [{"role": "user", "content": HELLO}]
    if kind == "completion":
        return "/v1/completions", {"prompt": HELLO, "max_tokens": max_tokens, "temperature": 0}
    if kind == "response":
        return "/v1/responses", {"input": HELLO, "max_output_tokens": max_tokens, "temperature": 0}
    stream = kind in ("stream", "abandon")
    return "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


async def one_request(session: aiohttp.ClientSession, base: str, kind: str, args, rng: random.Random) -> dict:
    """One request of `kind`: its status, latency and whether it did what a good (or bad) request must."""
    path, body = rng.choice(BAD) if kind == "bad" else good_request(kind, args.max_tokens)
    data = json.dumps(body).encode()  # Python's escapes: a lone surrogate travels as \ud800
    start = time.monotonic()
    async with session.post(f"{base}{path}", data=data, headers={"Content-Type": "application/json"}) as response:
        if kind == "abandon":
            await response.content.readline()  # the first chunk, then the client goes away
            response.close()
            return {"kind": kind, "status": response.status, "ok": response.status == 200, "latency": None}
        text = await response.text()
    latency = time.monotonic() - start
    if kind == "bad":
        return {"kind": kind, "status": response.status, "ok": 400 <= response.status < 500, "latency": None}
    if kind == "stream":
        complete = text.rstrip().endswith("data: [DONE]") and '"finish_reason"' in text and '"error"' not in text
    else:
        answer = json.loads(text) if response.status == 200 else {}
        complete = "usage" in answer and answer.get("status", "completed") == "completed"
    return {"kind": kind, "status": response.status, "ok": response.status == 200 and complete, "latency": latency}


async def client(session, base: str, args, stop_at: float, seed: int, results: list[dict]) -> None:
    rng = random.Random(seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    while time.monotonic() < stop_at:
        kind = rng.choices(kinds, weights)[0]
        try:
            outcome = await asyncio.wait_for(one_request(session, base, kind, args, rng), args.request_timeout)
        except asyncio.TimeoutError:
            outcome = {"kind": kind, "status": None, "ok": False, "latency": None, "hung": True}
        except aiohttp.ClientError as error:
            outcome = {"kind": kind, "status": None, "ok": False, "latency": None, "error": str(error)}
        results.append(outcome)


def resident_mib(process: subprocess.Popen) -> float:
    return psutil.Process(process.pid).memory_info().rss / 1024**2


async def drain(session, base: str, server: subprocess.Popen, args) -> tuple[float, bool]:
    """SIGTERM with streams in flight: the seconds until the server exited, and whether each stream got its end."""
    body = {"messages": [{"role": "user", "content": HELLO}], "stream": True}  # as long as the context allows
    responses = [await session.post(f"{base}/v1/chat/completions", json=body) for _ in range(4)]
    for response in responses:
        await response.content.readline()
    start = time.monotonic()
    server.send_signal(signal.SIGTERM)
    texts = await asyncio.gather(*(response.text() for response in responses))
    while server.poll() is None and time.monotonic() - start < 60:
        await asyncio.sleep(0.05)
    ended = all(text.rstrip().endswith("data: [DONE]") for text in texts)
    return time.monotonic() - start, ended and server.poll() is not None


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def run(args: argparse.Namespace) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(args.output or "load_test").with_suffix(".server.log")
    server = start_server(args, port, log)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=args.clients + 8)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await wait_healthy(session, base, server)
            rng = random.Random(args.seed)
            for index in range(args.warmup):
                await one_request(session, base, ("chat", "stream", "completion", "response")[index % 4], args, rng)
            warm = resident_mib(server)
            results: list[dict] = []
            start = time.monotonic()
            stop_at = start + args.duration
            await asyncio.gather(
                *(client(session, base, args, stop_at, args.seed + n, results) for n in range(args.clients))
            )
            elapsed = time.monotonic() - start
            await asyncio.sleep(2)  # abandoned streams' generations stop
            after = resident_mib(server)
            drain_s, drained = await drain(session, base, server, args)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    latencies = [result["latency"] for result in results if result["latency"] is not None and result["ok"]]
    good = [result for result in results if result["kind"] != "bad"]
    return {
        "continuous_batching": args.continuous_batching,
        "model": args.model or "the embedded default",
        "clients": args.clients,
        "duration_s": round(elapsed, 1),
        "requests": len(results),
        "requests_per_s": round(len(results) / elapsed, 2),
        "statuses": dict(Counter(str(result["status"]) for result in results)),
        "kinds": dict(Counter(result["kind"] for result in results)),
        "server_errors": sum(1 for result in results if (result["status"] or 0) >= 500),
        "hung": sum(1 for result in results if result.get("hung")),
        "client_errors": sum(1 for result in results if result.get("error")),
        "good_incomplete": sum(1 for result in good if not result["ok"]),
        "bad_not_4xx": sum(1 for result in results if result["kind"] == "bad" and not result["ok"]),
        "p50_latency_s": round(percentile(latencies, 0.5) or 0, 3),
        "p99_latency_s": round(percentile(latencies, 0.99) or 0, 3),
        "rss_after_warmup_mib": round(warm),
        "rss_after_run_mib": round(after),
        "rss_growth": round(after / warm - 1, 4),
        "sigterm_drain_s": round(drain_s, 2),
        "sigterm_streams_ended": drained,
    }


def failures(report: dict, args: argparse.Namespace) -> list[str]:
    failed = [
        name for name in ("server_errors", "hung", "client_errors", "good_incomplete", "bad_not_4xx") if report[name]
    ]
    if report["rss_growth"] > 0.10:
        failed.append("rss_growth above 10%")
    if report["sigterm_drain_s"] > args.drain_limit or not report["sigterm_streams_ended"]:
        failed.append("sigterm drain")
    return failed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(run(args))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted: the server was stopped.", file=sys.stderr)
        return 130
    except RuntimeError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    report["failed"] = failures(report, args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output is not None:
        from optimum.habana.utils.atomic import atomic_write_text

        atomic_write_text(args.output, text + "\n")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
