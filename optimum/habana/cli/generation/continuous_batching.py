"""`run_generation.py --continuous_batching`: the prompts as separate requests through transformers' continuous
batching (`generate_batch`, paged KV cache), each request timed on its own.

--batch_size means there what it means for a static batch, the most sequences generated together: the engine puts
at most that many requests in one step (its `max_requests_per_batch`). Every prompt is a request; fewer prompts
than --batch_size are cycled to fill it, as for a static batch, and more wait for a free place in the steps.

A request's time to first token runs from its submission (`created_time`) to its first token's timestamp;
its tokens/s are its new tokens over its time from submission to its last token. Overall throughput is every
request's new tokens over the wall time of the whole batch.
"""

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, PreTrainedTokenizerBase

from optimum.habana.utils.devices import synchronize


# What a refused family's run does instead (`check_engine_serves`), in the words of run_generation.py's options.
ENGINE_REFUSAL_REMEDY = "Drop --continuous_batching: generate() serves it."


# The cache geometry: pages of this many tokens, enough of them for every request at once.
PAGE_SIZE = 32


# Tokens per engine step (prompt chunks and decode tokens together): larger steps batch more work per forward.
DEFAULT_MAX_BATCH_TOKENS = 512


# Flags that shape generate()'s KV cache; continuous batching uses its own paged cache.
GENERATE_CACHE_FLAGS = ("static_shapes", "torch_compile", "reuse_cache", "use_hpu_graphs")


@dataclass(frozen=True)
class RequestStats:
    request_id: str
    prompt_tokens: int
    new_tokens: int
    time_to_first_token_seconds: float
    seconds: float  # submission to last token
    tokens_per_second: float
    status: str
    error: str | None


@dataclass(frozen=True)
class BatchRun:
    seconds: float  # wall time of the whole batch
    requests: list[RequestStats]
    generated: list[list[int]]  # each request's new tokens, in submission order


def request_prompts(pool: Sequence[str], batch_size: int) -> list[str]:
    """Every prompt of the pool a request, cycled to `batch_size` requests when the pool has fewer."""
    if len(pool) >= batch_size:
        return list(pool)
    return [pool[index % len(pool)] for index in range(batch_size)]


def batch_size_note(prompts: int, batch_size: int) -> str | None:
    """The line that says what --batch_size does here, when more prompts than it make the difference visible."""
    if prompts <= batch_size:
        return None
    return (
        f"--batch_size {batch_size} with --continuous_batching: the most requests the engine runs in one step (its "
        f"max_requests_per_batch); each of the {prompts} prompts is a request, and the others wait for a free place."
    )


def tokenize_requests(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_input_tokens: int
) -> list[list[int]]:
    """One unpadded token list per request; with `max_input_tokens` > 0, longer prompts keep their last tokens."""
    requests = [tokenizer(text, add_special_tokens=True)["input_ids"] for text in texts]
    if max_input_tokens > 0:
        requests = [ids[-max_input_tokens:] for ids in requests]
    return requests


def engine_config(
    prompt_lengths: Sequence[int],
    max_new_tokens: int,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    seed: int | None = None,
    max_requests: int | None = None,
) -> ContinuousBatchingConfig:
    """A paged cache sized from the workload: transformers otherwise sizes it from the device's free memory (seconds
    of allocation on a large CPU machine). `max_requests` bounds the requests of one step (None: every request at
    once), and the cache holds the largest that many together. `seed` seeds the engine's sampling (it samples in
    its own thread, after this process's own seeding), so that sampled texts repeat."""
    pages = sorted((math.ceil((length + max_new_tokens) / PAGE_SIZE) for length in prompt_lengths), reverse=True)
    return ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=sum(pages[:max_requests]) + 1,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
        seed=seed,
    )


def run_batch(
    model: Any,
    requests: Sequence[Sequence[int]],
    generation_config: Any,
    continuous_batching_config: ContinuousBatchingConfig,
    device: torch.device,
) -> BatchRun:
    """All requests through one `generate_batch`; a failed request is reported, not raised."""
    synchronize(device)
    start = time.perf_counter()
    outputs = model.generate_batch(
        inputs=[list(ids) for ids in requests],
        generation_config=generation_config,
        continuous_batching_config=continuous_batching_config,
        record_timestamps=True,
    )
    synchronize(device)
    seconds = time.perf_counter() - start
    stats = [request_stats(output) for output in outputs.values()]
    return BatchRun(seconds, stats, [list(output.generated_tokens) for output in outputs.values()])


def request_stats(output: Any) -> RequestStats:
    timestamps = output.timestamps or []
    new_tokens = len(output.generated_tokens)
    first = timestamps[0] - output.created_time if timestamps else math.nan
    seconds = timestamps[-1] - output.created_time if timestamps else math.nan
    return RequestStats(
        request_id=output.request_id,
        prompt_tokens=len(output.prompt_ids),
        new_tokens=new_tokens,
        time_to_first_token_seconds=first,
        seconds=seconds,
        tokens_per_second=new_tokens / seconds if new_tokens and seconds > 0 else 0.0,
        status=output.status.name.lower(),
        error=output.error,
    )


def summarize_batches(runs: Sequence[BatchRun]) -> dict[str, Any]:
    """Medians over the measured runs; the per-request figures of the median run."""
    throughputs = [sum(request.new_tokens for request in run.requests) / run.seconds for run in runs]
    median_run = sorted(runs, key=lambda run: run.seconds)[len(runs) // 2]
    ttfts = [request.time_to_first_token_seconds for request in median_run.requests if request.new_tokens]
    generation_seconds = statistics.median(run.seconds for run in runs)
    return {
        "throughput_tokens_per_second": statistics.median(throughputs),
        "generation_seconds": generation_seconds,
        # Optimum-Habana's averages (results.json): first token per request; end to end, the whole batch.
        "avg_first_token_latency_seconds": statistics.fmean(ttfts) if ttfts else None,
        "avg_rest_token_latency_seconds": None,
        "avg_e2e_latency_seconds": generation_seconds,
        "requests": len(median_run.requests),
        "failed_requests": sum(request.error is not None for request in median_run.requests),
        "new_tokens": sum(request.new_tokens for request in median_run.requests),
        "median_time_to_first_token_seconds": statistics.median(ttfts) if ttfts else None,
        "max_time_to_first_token_seconds": max(ttfts) if ttfts else None,
        "median_request_tokens_per_second": statistics.median(
            request.tokens_per_second for request in median_run.requests
        ),
        "per_request": [asdict(request) for request in median_run.requests],
        "runs_seconds": [run.seconds for run in runs],
    }


def format_request_table(stats: dict[str, Any]) -> str:
    """One line per request, then the overall figures."""
    lines = [f"{'request':>8} {'prompt':>7} {'new':>5} {'TTFT (s)':>9} {'tokens/s':>9}  status"]
    for request in stats["per_request"]:
        lines.append(
            f"{request['request_id']:>8} {request['prompt_tokens']:>7} {request['new_tokens']:>5} "
            f"{request['time_to_first_token_seconds']:>9.3f} {request['tokens_per_second']:>9.1f}  {request['status']}"
            + (f": {request['error']}" if request["error"] else "")
        )
    ttft = stats["median_time_to_first_token_seconds"]
    lines.append(
        f"{stats['requests']} requests ({stats['failed_requests']} failed), {stats['new_tokens']} new tokens in "
        f"{stats['generation_seconds']:.2f} s: {stats['throughput_tokens_per_second']:.1f} tokens/s overall; median "
        f"time to first token {'n/a' if ttft is None else f'{ttft:.3f} s'}"
    )
    return "\n".join(lines)
