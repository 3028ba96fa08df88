"""The measured runs of run_generation.py: warm-up and timed generate() calls, the first token timed inside each, and
the medians and averages reported.
"""

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    set_seed,
)
from transformers.cache_utils import Cache
from transformers.tokenization_utils_base import BatchEncoding

from optimum.habana.transformers.generation import GaudiGenerationConfig
from optimum.habana.utils.devices import synchronize


class FirstTokenTimer(LogitsProcessor):
    """Records when the logits of the first new token are ready.

    generate() calls its logits processors once per step, the first time right after the prompt's forward pass,
    in greedy, sampling and beam search alike, so this times the first token inside the measured run itself.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.time: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.time is None:
            synchronize(self.device)  # once per run: the device must have finished the prompt
            self.time = time.perf_counter()
        return scores


@dataclass
class RunMeasurement:
    seconds: float
    first_token_seconds: float
    new_tokens: int  # per sequence: generate() runs until the longest sequence is done


@dataclass
class BenchmarkResult:
    output: torch.Tensor  # token ids of the last measured run, prompt included
    runs: list[RunMeasurement]  # the measured runs, warm-up excluded
    warmup_seconds: float


def timed_generate(
    model: Any,
    inputs: BatchEncoding,
    generation_config: GaudiGenerationConfig,
    device: torch.device,
    seed: int,
    cache: Cache | None = None,
) -> tuple[torch.Tensor, RunMeasurement]:
    """One generate() call, timed from start to end and to its first token; the seed is set first."""
    set_seed(seed)
    timer = FirstTokenTimer(device)
    cache_argument = {} if cache is None else {"past_key_values": cache}
    synchronize(device)
    start = time.perf_counter()
    output = model.generate(
        **inputs,
        **cache_argument,
        generation_config=generation_config,
        logits_processor=LogitsProcessorList([timer]),
    )
    synchronize(device)
    end = time.perf_counter()
    new_tokens = output.shape[1] - inputs["input_ids"].shape[1]
    first_token = (timer.time if timer.time is not None else end) - start
    return output, RunMeasurement(seconds=end - start, first_token_seconds=first_token, new_tokens=new_tokens)


def benchmark(
    model: Any,
    inputs: BatchEncoding,
    generation_config: GaudiGenerationConfig,
    *,
    device: torch.device,
    seed: int,
    warmup: int,
    n_iterations: int,
    cache_supply: Callable[[], Cache | None] = lambda: None,
) -> BenchmarkResult:
    """`warmup` untimed runs (compilation happens there), then `n_iterations` measured ones.

    A progress bar goes to stderr when it is a terminal, so logs and redirected output stay clean.
    """
    progress = tqdm(total=warmup + n_iterations, unit="run", desc="warm-up", disable=not sys.stderr.isatty())
    output = None
    warmup_start = time.perf_counter()
    for _ in range(warmup):
        output, _ = timed_generate(model, inputs, generation_config, device, seed, cache_supply())
        progress.update()
    warmup_seconds = time.perf_counter() - warmup_start
    progress.set_description("generate")
    runs = []
    for _ in range(n_iterations):
        output, run = timed_generate(model, inputs, generation_config, device, seed, cache_supply())
        runs.append(run)
        progress.update()
    progress.close()
    return BenchmarkResult(output=output, runs=runs, warmup_seconds=warmup_seconds)


def summarize_runs(runs: Sequence[RunMeasurement], batch_size: int) -> dict[str, Any]:
    """Medians over the measured runs (throughput is batch x new tokens / generation time, per run), and the
    averages Optimum-Habana reports: first token, each later token, and end to end."""
    throughputs = [batch_size * run.new_tokens / run.seconds for run in runs]
    rest_token_latencies = [
        (run.seconds - run.first_token_seconds) / (run.new_tokens - 1) for run in runs if run.new_tokens > 1
    ]
    return {
        "throughput_tokens_per_second": statistics.median(throughputs),
        "first_token_latency_seconds": statistics.median(run.first_token_seconds for run in runs),
        "generation_seconds": statistics.median(run.seconds for run in runs),
        "avg_first_token_latency_seconds": statistics.fmean(run.first_token_seconds for run in runs),
        "avg_rest_token_latency_seconds": statistics.fmean(rest_token_latencies) if rest_token_latencies else None,
        "avg_e2e_latency_seconds": statistics.fmean(run.seconds for run in runs),
        "batch_size": batch_size,
        "new_tokens": int(statistics.median(run.new_tokens for run in runs)),
        "runs": [dataclasses.asdict(run) for run in runs],
    }
