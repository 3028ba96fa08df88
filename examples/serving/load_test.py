#!/usr/bin/env python
"""A bounded load test of `python -m optimum.habana.serve`: many clients, good and bad requests, cancellations.

    python examples/serving/load_test.py --clients 64 --duration 60 --continuous-batching --output load.json

As many clients as kinds of request (7) send each kind at least once.

Starts the server (MODEL: `--model`, else its embedded default) on 127.0.0.1 as a subprocess, warms it up, then
runs `--clients` asyncio clients for `--duration` seconds. Each client loops over a mix: chat completions whole
and streamed, completions, responses, streams it abandons after the first chunk (the client disconnects), bad
requests (each must be a 4xx), and hostile bodies (a 50 MB body, 2,048 messages of 6,000 characters, stop strings
of 1 MB, JSON nested 50,000 deep, a 5,000-digit number...: each must be a 4xx). Meanwhile `/health` is asked twice
a second. Every request has a bound (`--request-timeout`): one that passes it is counted as hanging. Then the
server gets SIGTERM with streams in flight and must exit within `--drain-limit` seconds.

It reports requests per second, p50 and p99 latency of the good requests, the slowest `/health`, the server's
resident memory after warm-up and after the run, and the drain time; it exits 1 when a criterion fails: a 5xx, a
request left hanging, a good request that did not complete (a stream without its end; when every good request was
refused, it says so and why), a bad or hostile request answered other than 4xx, a `/health` slower than
`--health-limit`, resident memory after the run more than 10% above after warm-up, or a drain slower than the
limit. It only talks to the loopback address, and stops by itself.
"""

import argparse
import asyncio
import functools
import json
import math
import os
import random
import resource
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
KINDS = {"chat": 30, "stream": 25, "completion": 10, "response": 10, "abandon": 10, "bad": 10, "hostile": 5}


def chat_bytes(content: str, **fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], **fields}).encode()


# Hostile bodies, sent raw to /v1/chat/completions: (body, the Content-Length declared where only the headers go).
# Each must be a 4xx (a 413 or a 400), answered while the others are served.
HOSTILE = {
    "50-MB-declared": lambda: (b"", 50_000_000),
    "2048-messages-of-6000-characters": lambda: (
        json.dumps({"messages": [{"role": "user", "content": "w " * 3000}] * 2048}).encode(),
        None,
    ),
    "a-prompt-of-4-MB": lambda: (chat_bytes("hello " * 700_000, max_tokens=4), None),
    "4-stop-strings-of-1-MB": lambda: (chat_bytes("hi", stop=["s" * 1_000_000] * 4), None),
    "4-stop-strings-of-65-characters": lambda: (chat_bytes("hi", stop=["s" * 65] * 4), None),
    "nested-50000-deep": lambda: (b"[" * 50_000 + b"]" * 50_000, None),
    "a-5000-digit-number": lambda: (b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}", None),
}


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
    parser.add_argument("--health-limit", type=float, default=1, help="seconds /health may take (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="the mix's random seed")
    parser.add_argument("--output", type=Path, help="write the report as JSON there (its folder must exist)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output and its server log")
    args = parser.parse_args(argv)
    for name in ("clients", "duration", "max_tokens", "request_timeout", "drain_limit", "health_limit"):
        value = getattr(args, name)
        if not math.isfinite(value) or value <= 0:  # nan passes `<= 0`: a run of no request would pass
            parser.error(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more requests, got {args.warmup}")
    if args.output is not None and not args.output.parent.is_dir():
        parser.error(f"--output {args.output}: the folder {args.output.parent} does not exist; create it first")
    if args.output is not None and args.output.is_dir():
        parser.error(f"--output {args.output} is a folder: give the path of the JSON file to write")
    if args.output is not None and args.output.exists() and not args.overwrite:
        parser.error(f"--output {args.output} exists: add --overwrite to replace it, or give another path")
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if files != resource.RLIM_INFINITY and args.clients + FILES_BESIDES_CLIENTS > files:
        parser.error(
            f"--clients {args.clients} needs as many connections, and this process may open {files} files "
            f"(ulimit -n): take at most {files - FILES_BESIDES_CLIENTS} clients, or raise the limit"
        )
    return args


PORT_ATTEMPTS = 3  # a free port is probed, then bound by the server: another process can take it in between
FILES_BESIDES_CLIENTS = 64  # the health probe, hostile connections, the server's pipes and log, Python's own


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def start_healthy_server(
    session: aiohttp.ClientSession, args: argparse.Namespace, log: Path
) -> tuple[subprocess.Popen, str]:
    """The server answering `/health`, and its address; a port taken between the probe and the bind is replaced."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        server, address = start_server(args, port, log), f"http://127.0.0.1:{port}"
        try:
            await wait_healthy(session, address, server, log)
        except PortTaken:
            if attempt == PORT_ATTEMPTS:
                raise
            continue
        except BaseException:
            stop_server(server)
            raise
        return server, address
    raise AssertionError("the loop returns or raises")


def stop_server(server: subprocess.Popen | None) -> None:
    if server is not None and server.poll() is None:
        server.kill()
        server.wait()


def start_server(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "optimum.habana.serve", *([args.model] if args.model else [])]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--continuous-batching"] if args.continuous_batching else []
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))}
    env.pop("OPTIMUM_HABANA_API_KEY", None)
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"), env=env)


class PortTaken(RuntimeError):
    """The port was free when probed and taken before the server bound it (by another process's connection)."""


async def wait_healthy(session: aiohttp.ClientSession, base: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            said = (log.read_text(errors="replace").strip().splitlines() or ["(nothing)"])[-1]
            problem = PortTaken if " is in use on 127.0.0.1" in said else RuntimeError
            raise problem(f"the server exited with {server.returncode} before it served; its last line: {said}")
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


@functools.cache
def hostile_body(name: str) -> tuple[bytes, int | None]:
    return HOSTILE[name]()


async def hostile_request(port: int, rng: random.Random) -> dict:
    """One hostile body, sent raw: its headers first with `Expect: 100-continue` (as curl sends a large body), its
    body once the server asks for it. It must be a 4xx; a server that refuses by the headers reads no body."""
    name = rng.choice(sorted(HOSTILE))
    body, declared = hostile_body(name)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared or len(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n"
    )
    try:
        writer.write(head.encode())
        status = await read_status(reader)
        if status == 100 and not declared:
            await reader.readline()  # the interim answer's blank line
            writer.write(body)
            await writer.drain()
            status = await read_status(reader)
    except ConnectionError:
        status = None
    finally:
        writer.close()
    return {"kind": "hostile", "name": name, "status": status, "ok": status is not None and 400 <= status < 500}


async def read_status(reader: asyncio.StreamReader) -> int | None:
    parts = (await reader.readline()).split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


async def one_request(session: aiohttp.ClientSession, base: str, kind: str, args, rng: random.Random) -> dict:
    """One request of `kind`: its status, latency and whether it did what a good (or bad) request must."""
    if kind == "hostile":
        outcome = await hostile_request(int(base.rsplit(":", 1)[1]), rng)
        return {**outcome, "latency": None}
    path, body = rng.choice(BAD) if kind == "bad" else good_request(kind, args.max_tokens)
    data = json.dumps(body).encode()  # Python's escapes: a lone surrogate travels as \ud800
    start = time.monotonic()
    async with session.post(f"{base}{path}", data=data, headers={"Content-Type": "application/json"}) as response:
        if kind == "abandon" and response.status == 200:
            await response.content.readline()  # the first chunk, then the client goes away
            response.close()
            return {"kind": kind, "status": response.status, "ok": True, "latency": None}
        text = await response.text()
    latency = time.monotonic() - start
    if kind == "bad":
        return {"kind": kind, "status": response.status, "ok": 400 <= response.status < 500, "latency": None}
    if response.status != 200:  # a good request refused: why, for the report
        return {"kind": kind, "status": response.status, "ok": False, "latency": latency, "why": refusal(text)}
    if kind == "stream":
        complete = text.rstrip().endswith("data: [DONE]") and '"finish_reason"' in text and '"error"' not in text
    else:
        answer = json.loads(text)
        complete = "usage" in answer and answer.get("status", "completed") == "completed"
    return {"kind": kind, "status": response.status, "ok": complete, "latency": latency}


def refusal(text: str) -> str:
    """An error answer's message (OpenAI's shape), else its first characters."""
    try:
        return str(json.loads(text)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return text[:300]


async def watch_health(session: aiohttp.ClientSession, base: str, stop_at: float, latencies: list[float]) -> None:
    """/health twice a second while the clients run: its latency (infinite when it failed)."""
    while time.monotonic() < stop_at:
        start = time.monotonic()
        try:
            async with session.get(f"{base}/health") as response:
                await response.read()
                healthy = response.status == 200
        except aiohttp.ClientError:
            healthy = False
        latencies.append(time.monotonic() - start if healthy else math.inf)
        await asyncio.sleep(0.5)


async def client(session, base: str, args, stop_at: float, number: int, results: list[dict]) -> None:
    """Client `number`'s requests until `stop_at`: its first of the `number`-th kind (so that as many clients as
    kinds send every kind), then a random mix."""
    rng = random.Random(args.seed + number)
    kinds, weights = list(KINDS), list(KINDS.values())
    kind = kinds[number % len(kinds)]
    while time.monotonic() < stop_at:
        try:
            outcome = await asyncio.wait_for(one_request(session, base, kind, args, rng), args.request_timeout)
        except asyncio.TimeoutError:
            outcome = {"kind": kind, "status": None, "ok": False, "latency": None, "hung": True}
        except aiohttp.ClientError as error:
            outcome = {"kind": kind, "status": None, "ok": False, "latency": None, "error": str(error)}
        results.append(outcome)
        kind = rng.choices(kinds, weights)[0]


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


class RefusedSettings(ValueError):
    """The server refuses the good requests these settings make: a usage error, found before the measured run."""


async def run(args: argparse.Namespace) -> dict:
    log = Path(args.output or "load_test").with_suffix(".server.log")
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=args.clients + 8)
    server = None
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            server, base = await start_healthy_server(session, args, log)
            rng = random.Random(args.seed)
            # One good request first: one the server refuses (--max-tokens past the model's context, say) would make
            # every good request of the run a refusal.
            probe = await one_request(session, base, "chat", args, rng)
            if probe["status"] is not None and 400 <= probe["status"] < 500:
                raise RefusedSettings(
                    f"the server refuses a good request with --max-tokens {args.max_tokens} "
                    f"({probe['status']}: {probe['why']}): lower --max-tokens"
                )
            for index in range(args.warmup):
                await one_request(session, base, ("chat", "stream", "completion", "response")[index % 4], args, rng)
            warm = resident_mib(server)
            results: list[dict] = []
            health: list[float] = []
            start = time.monotonic()
            stop_at = start + args.duration
            await asyncio.gather(
                watch_health(session, base, stop_at, health),
                *(client(session, base, args, stop_at, number, results) for number in range(args.clients)),
            )
            elapsed = time.monotonic() - start
            await asyncio.sleep(2)  # abandoned streams' generations stop
            after = resident_mib(server)
            drain_s, drained = await drain(session, base, server, args)
    finally:
        stop_server(server)
    latencies = [result["latency"] for result in results if result["latency"] is not None and result["ok"]]
    good = [result for result in results if result["kind"] not in ("bad", "hostile")]
    refused = [result for result in good if result["status"] is not None and 400 <= result["status"] < 500]
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
        "good_refused": len(refused),
        "good_refused_because": dict(Counter(f"{result['status']}: {result['why']}" for result in refused)),
        "bad_not_4xx": sum(1 for result in results if result["kind"] == "bad" and not result["ok"]),
        "hostile_not_4xx": dict(
            Counter(result["name"] for result in results if result["kind"] == "hostile" and not result["ok"])
        ),
        "health_max_latency_s": round(max(health, default=math.inf), 3),
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
        name
        for name in ("server_errors", "hung", "client_errors", "good_incomplete", "bad_not_4xx", "hostile_not_4xx")
        if report[name]
    ]
    if not any(count for kind, count in report["kinds"].items() if kind not in ("bad", "hostile")):
        failed.append("no good request was sent: a run that tests nothing does not pass")
    if report["health_max_latency_s"] > args.health_limit:
        failed.append(f"/health slower than {args.health_limit} s")
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
    except RefusedSettings as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    report["failed"] = failures(report, args)
    text = json.dumps(report, indent=2)
    print(text)
    good = sum(count for kind, count in report["kinds"].items() if kind not in ("bad", "hostile"))
    if good and report["good_refused"] == good:
        reasons = "; ".join(f"{count} x {why}" for why, count in report["good_refused_because"].items())
        print(f"{PROG}: every good request was refused: {reasons}", file=sys.stderr)
    if args.output is not None:
        from optimum.habana.utils.atomic import atomic_write_text

        atomic_write_text(args.output, text + "\n")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
