"""What four stop strings of 63 characters cost a chat request, side by side in one run: none, the server's
`TailStopStringCriteria`, and transformers' `StopStringCriteria` (its vocabulary-wide tables). A measurement for
docs/serving.md, not a test (timings assert nothing in the suite):

    python -m tests.serving.stop_strings_cost --rounds 5 --max-tokens 8

The embedded SmolLM2 (converted into the user's cache if it is not there yet) served in this process, greedy, the
same prompt every time; each request gets four new stop strings (transformers caches its tables per set of stop
strings, a server's clients send their own) that never match, so that every request generates `--max-tokens`.
Each request's wall time and the CPU time the process spent on it (steadier on a machine shared with other work)
are printed, the medians beside the request without stop strings.
"""

import argparse
import random
import statistics
import string
import time
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import torch

from optimum.habana.cli.serving.server import GaudiServe
from optimum.habana.transformers.generation.utils import GaudiGenerationMixin
from optimum.habana.utils.model_loading import resolve_model
from tests.serving.servers import listening_port, wait_until_healthy


STOP_CHARACTERS = 63


@contextmanager
def transformers_stop_strings() -> Iterator[None]:
    """generate() with transformers' own stopping criteria (StopStringCriteria) while inside."""
    ours = GaudiGenerationMixin.__dict__["_get_stopping_criteria"]
    del GaudiGenerationMixin._get_stopping_criteria
    try:
        yield
    finally:
        GaudiGenerationMixin._get_stopping_criteria = ours


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the generation")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_model(None).path
    serve = GaudiServe(
        attention_flags={}, force_model=str(path), device="cpu", host="127.0.0.1", port=0, non_blocking=True
    )
    try:
        base_url = f"http://127.0.0.1:{listening_port(serve.server)}"
        wait_until_healthy(base_url)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
        rng = random.Random(0)

        def chat(stop: list[str] | None) -> tuple[float, float, int]:
            start, cpu = time.perf_counter(), time.process_time()
            answer = client.chat.completions.create(
                model=str(path),
                messages=[{"role": "user", "content": "Tell me about the sea."}],
                max_tokens=args.max_tokens,
                temperature=0,
                stop=stop,
            )
            return time.perf_counter() - start, time.process_time() - cpu, answer.usage.completion_tokens

        def four_stops() -> list[str]:
            return ["".join(rng.choices(string.ascii_uppercase, k=STOP_CHARACTERS - 1)) + "|" for _ in range(4)]

        chat(None)  # warm-up
        names = ("no stop strings", "TailStopStringCriteria", "StopStringCriteria")
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                if name == "StopStringCriteria":
                    with transformers_stop_strings():
                        wall, cpu, tokens = chat(four_stops())
                else:
                    wall, cpu, tokens = chat(four_stops() if name == "TailStopStringCriteria" else None)
                assert tokens == args.max_tokens, (name, tokens)
                times[name].append((wall, cpu))
        base_wall, base_cpu = (statistics.median(pair[kind] for pair in times[names[0]]) for kind in (0, 1))
        for name, pairs in times.items():
            wall, cpu = (statistics.median(pair[kind] for pair in pairs) for kind in (0, 1))
            walls = ", ".join(f"{pair[0]:.2f}" for pair in pairs)
            print(
                f"{name:23} wall {wall:6.3f} s ({wall / base_wall:.2f}x), CPU {cpu:6.3f} s ({cpu / base_cpu:.2f}x); "
                f"walls: {walls}"
            )
    finally:
        serve.kill_server()


if __name__ == "__main__":
    main()
