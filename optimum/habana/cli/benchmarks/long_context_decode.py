"""benchmark_long_context_decode.py's measurements: decode steps at a long context, the paths side by side in one
process, each from a copy of the same prefilled cache.

A path is a model and the cache its generate() builds by default: this library's class with and without
`use_flash_attention` (a `GrowingCache`), stock transformers with SDPA and eager attention (a `DynamicCache`). A
round times every path's decode steps at the long context and at `BASE_CONTEXT` tokens (the first tokens of the
same cache), one step of each in turn; rounds alternate the paths' order, and the table takes the median over rounds
of each round's median step. What a step gains with the context (the median over a round's pairs of step at L minus
step at BASE_CONTEXT, then the median over rounds) is compared with the time it takes to read the keys and values
once at the read rate a batch-1 linear layer reaches: measured after each pair of steps (`ReadProbe`), so that each
round's cost is divided by the same round's read, on a machine whose memory is shared with other jobs.
"""

import contextlib
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache
from transformers.initialization import no_init_weights

from optimum.habana.cli.benchmarks.compiled_decode import median_seconds
from optimum.habana.cli.benchmarks.models import ModelSpec, build_model
from optimum.habana.kernels import cpu_decode, dispatch, split_context
from optimum.habana.transformers.growing_cache import GrowingCache
from optimum.habana.utils.devices import memory_stats, reset_peak_memory, synchronize


BASE_CONTEXT = 64  # tokens: the context whose step time the context cost is measured from
PATHS = ("flag", "default", "stock sdpa", "stock eager")
# The flag on PyTorch's flash kernel, without `kernels.cpu_decode`'s decode kernel (the context still cut where
# `kernels.split_context` would), and on PyTorch's kernel with each decode step's context in one call.
PYTORCH_KERNEL = "flag, PyTorch kernel"
WHOLE_CONTEXT = "flag, whole context"
# Each path's whole step is compared with this one's, same shape, same run.
REFERENCE = {"flag": "stock sdpa", PYTORCH_KERNEL: "stock sdpa", WHOLE_CONTEXT: "stock sdpa", "default": "stock eager"}
MIB = 1024**2
STEP = "the whole step (wall clock)"
DECODE_KERNEL = "optimum.habana.kernels.cpu_decode (the decode kernel)"


@dataclass(frozen=True)
class DecodePath:
    name: str
    model: torch.nn.Module
    forward_kwargs: dict[str, Any]
    growing_cache: bool  # the cache a Gaudi model's generate() builds, or stock's DynamicCache
    decode_kernel: bool = True  # the CPU decode kernel where it applies (off: PyTorch's flash kernel)
    whole_context: bool = False  # never cut the context of a decode step into pieces


@dataclass
class PathTiming:
    """One path at one shape: the median step per round at the long context and at BASE_CONTEXT, and each round's
    context cost (the median of its paired steps' differences, where the steps alternate between the contexts)."""

    long_steps: list[float] = field(default_factory=list)
    base_steps: list[float] = field(default_factory=list)
    round_costs: list[float] = field(default_factory=list)
    # each round's time to read the keys and values once, at the rate `ReadProbe` measured between its pairs
    round_reads: list[float] = field(default_factory=list)
    tokens: torch.Tensor | None = None  # the greedy tokens of its steps at the long context (first round)
    cache_bytes: int = 0  # what its cache holds at the long context after the steps
    step_peak_bytes: int = 0  # the most memory above the start that its steps at the long context needed at once

    @property
    def long_step(self) -> float:
        return statistics.median(self.long_steps)

    @property
    def context_cost(self) -> float:
        return statistics.median(self.round_costs)

    @property
    def noise(self) -> float:
        """The spread of the rounds' context costs: a cost within it is not measured (with one round nothing says how
        large it is: only a cost above zero counts). Each round's cost is a difference of steps taken side by side,
        so a machine that slows down between rounds moves both of its terms."""
        return max(self.round_costs) - min(self.round_costs)

    @property
    def context_cost_measured(self) -> bool:
        return self.context_cost > self.noise

    @property
    def kv_read(self) -> float:
        return statistics.median(self.round_reads)

    @property
    def cost_per_read(self) -> float:
        """The median over rounds of each round's context cost over the same round's read: a machine whose memory
        slows down between rounds moves both."""
        return statistics.median(cost / read for cost, read in zip(self.round_costs, self.round_reads, strict=True))


class ReadProbe:
    """A batch-1 linear layer whose weight is far larger than the caches: it reads at the rate a decode step's weights
    and, at best, its keys and values are read at. Kept for the run, so that a read can be timed between any two
    steps."""

    def __init__(self, device: torch.device, dtype: torch.dtype, mib: int = 256) -> None:
        columns = 4096
        rows = mib * MIB // (columns * torch.empty((), dtype=dtype).element_size())
        self.weight = torch.randn(rows, columns, dtype=dtype).to(device)
        self.vector = torch.randn(1, columns, dtype=dtype, device=device)
        self.device = device
        self.bytes = self.weight.numel() * self.weight.element_size()

    def read(self) -> torch.Tensor:
        return self.vector @ self.weight.T

    def read_seconds(self) -> float:
        """One read of the weight, timed."""
        synchronize(self.device)
        start = time.perf_counter()
        self.read()
        synchronize(self.device)
        return time.perf_counter() - start

    def rate(self, repeats: int = 9) -> float:
        """Bytes per second: the median of `repeats` reads."""
        return self.bytes / median_seconds(self.read, self.device, repeats)


def decode_paths(
    spec: ModelSpec,
    dtype: torch.dtype,
    seed: int,
    pytorch_kernel: bool = False,
    whole_context: bool = False,
    device: torch.device | str = "cpu",
) -> list[DecodePath]:
    """The four paths over one set of weights (the stock models share the Gaudi model's tensors) on `device`, and on
    request the flag on PyTorch's flash kernel (`pytorch_kernel`), and with each decode step's context in one call of
    it (`whole_context`): what the CPU's decode kernel and the context cut gain."""
    ours = build_model(spec, "flash", dtype, seed).eval().to(device)
    stock = {}
    for attention in ("sdpa", "eager"):
        try:
            with no_init_weights():  # ours replace its weights below: drawing random ones took most of a small run
                model = build_model(spec, attention, dtype, seed).eval()
        except ValueError:  # a family whose stock class has no sdpa (gpt-oss): its rows compare with stock eager
            continue
        model.load_state_dict(ours.state_dict(), assign=True)
        stock[attention] = model.to(device)  # its buffers (rotary frequencies) were not assigned
    paths = [
        DecodePath("flag", ours, {"use_flash_attention": True}, growing_cache=True),
        DecodePath("default", ours, {"use_flash_attention": False}, growing_cache=True),
        *[DecodePath(f"stock {name}", model, {}, growing_cache=False) for name, model in stock.items()],
    ]
    flag = {"use_flash_attention": True}
    if whole_context:
        paths.insert(1, DecodePath(WHOLE_CONTEXT, ours, flag, True, decode_kernel=False, whole_context=True))
    if pytorch_kernel:
        paths.insert(1, DecodePath(PYTORCH_KERNEL, ours, flag, True, decode_kernel=False))
    return paths


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token adds to the cache of one sequence (SmolLM2 fp32: 46,080), in the layers
    whose cache grows with the context (a sliding window's does not); latent attention's as transformers 5 caches
    it, compressed (the latent and the rotary key part: the family expands them into every head's keys and values at
    every step, in its own code)."""
    element = torch.empty((), dtype=dtype).element_size()
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    layers = sum(kind == "full_attention" for kind in kinds)
    if getattr(config, "kv_lora_rank", None):
        return layers * (config.kv_lora_rank + config.qk_rope_head_dim) * element
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * layers * config.num_key_value_heads * head_dim * element


def absorbed_products_per_token(config: Any) -> int:
    """Floating-point operations a decode step of latent attention does per cached token and sequence when it attends
    over the compressed cache (`kernels/latent.py`): each head's scores against the latent and the rotary key, then
    its weighted sum of latents, over every full-attention layer; 0 for any other attention."""
    if not getattr(config, "kv_lora_rank", None):
        return 0
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    layers = sum(kind == "full_attention" for kind in kinds)
    return 2 * layers * config.num_attention_heads * (2 * config.kv_lora_rank + config.qk_rope_head_dim)


def absorbed_product_rate(
    config: Any, context: int, dtype: torch.dtype, device: torch.device, repeats: int = 9
) -> float:
    """Floating-point operations per second of the absorbed step's largest product on `device`: every head's
    latent query against `context` cached latents, `[1, H, L] @ [1, L, context]`, as `kernels.latent` runs it."""
    heads, latent = config.num_attention_heads, config.kv_lora_rank
    rows = torch.randn(1, heads, latent, dtype=dtype, device=device)
    cache = torch.randn(1, context, latent, dtype=dtype, device=device)
    return (
        2
        * heads
        * latent
        * context
        / median_seconds(lambda: torch.bmm(rows, cache.transpose(1, 2)), rows.device, repeats)
    )


def prompt_ids(config: Any, batch: int, context: int, seed: int) -> torch.Tensor:
    """The random prompt of a shape (`[batch, context]` token ids), the same for every path."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, config.vocab_size, (batch, context), generator=generator)


@torch.no_grad()
def prefill(
    model: torch.nn.Module, batch: int, context: int, seed: int, random_cache: bool
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Each layer's keys and values after a prompt of `context` random tokens, and the first greedy token.

    With `random_cache` the keys and values are random numbers of the right shapes instead (a synthetic model's
    weights are random too): a prompt of 32k tokens takes the CPU longer than every decode step of the table.
    """
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    config = model.config
    ids = prompt_ids(config, batch, context, seed).to(device)
    if not random_cache:
        output = model(input_ids=ids, use_cache=True, logits_to_keep=1, use_flash_attention=True)
        layers = output.past_key_values.layers
        return [(layer.keys, layer.values) for layer in layers], output.logits[:, -1:].argmax(-1)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shapes = [(batch, config.num_key_value_heads, context, head_dim)] * 2
    if getattr(config, "kv_lora_rank", None):  # latent attention caches the latent and the rotary key, one head each
        shapes = [(batch, 1, context, config.kv_lora_rank), (batch, 1, context, config.qk_rope_head_dim)]
    dtype = next(model.parameters()).dtype
    layers = [
        tuple(torch.randn(shape, generator=generator, dtype=dtype).to(device) for shape in shapes)
        for _ in range(config.num_hidden_layers)
    ]
    return layers, ids[:, -1:]


def filled_cache(path: DecodePath, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int, steps: int) -> Cache:
    """A copy of the first `length` tokens of the prefilled cache, as the path's generate() would hold them after
    its prompt (a generation of `steps` more tokens)."""
    config = path.model.config
    cache = GrowingCache(config, length + steps) if path.growing_cache else DynamicCache(config=config)
    for index, (keys, values) in enumerate(kv):
        cache.update(keys[:, :, :length].contiguous(), values[:, :, :length].contiguous(), index)
    return cache


def cache_bytes(cache: Cache) -> int:
    """Bytes the cache holds: its tensors' whole storage, room to spare included."""
    tensors = [tensor for layer in cache.layers for tensor in (layer.keys, layer.values) if tensor is not None]
    return sum(tensor.untyped_storage().nbytes() for tensor in tensors)


@torch.no_grad()
def timed_steps(
    path: DecodePath, cache: Cache, first_token: torch.Tensor, steps: int
) -> tuple[list[float], torch.Tensor]:
    """`steps` greedy decode steps: each one's seconds, and the tokens."""
    token, tokens, seconds = first_token, [], []
    with path_settings(path):
        for _ in range(steps):
            elapsed, token = one_step(path, cache, token)
            seconds.append(elapsed)
            tokens.append(token)
    return seconds, torch.cat(tokens, dim=-1)


@torch.no_grad()
def paired_steps(
    path: DecodePath,
    cache: Cache,
    base_cache: Cache,
    first_token: torch.Tensor,
    steps: int,
    between: Callable[[], float] | None = None,
) -> tuple[list[float], list[float], torch.Tensor, list[float]]:
    """`steps` greedy decode steps over each cache, alternating one over `cache` and one over `base_cache`: the
    seconds of each, the tokens over `cache`, and what `between` (called after each pair) returned. Side by side,
    the two steps of a pair see the same machine."""
    token, base_token, tokens, seconds, base_seconds, measured = first_token, first_token, [], [], [], []
    with path_settings(path):
        for _ in range(steps):
            elapsed, token = one_step(path, cache, token)
            seconds.append(elapsed)
            tokens.append(token)
            elapsed, base_token = one_step(path, base_cache, base_token)
            base_seconds.append(elapsed)
            if between is not None:
                measured.append(between())
    return seconds, base_seconds, torch.cat(tokens, dim=-1), measured


@contextlib.contextmanager
def path_settings(path: DecodePath) -> Iterator[None]:
    """The kernel switches a path's row names: the decode kernel off, the context never cut."""
    with contextlib.ExitStack() as settings:
        if not path.decode_kernel:
            settings.enter_context(mock.patch.dict(os.environ, {cpu_decode.ENV_VAR: "0"}))
        if path.whole_context:
            settings.enter_context(mock.patch.object(split_context, "MIN_PIECE_TOKENS", sys.maxsize))
        yield


def one_step(path: DecodePath, cache: Cache, token: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One greedy decode step's seconds, and its token."""
    device = token.device
    synchronize(device)
    start = time.perf_counter()
    output = path.model(
        input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1, **path.forward_kwargs
    )
    token = output.logits[:, -1:].argmax(-1)
    synchronize(device)
    return time.perf_counter() - start, token


def measure_shape(
    paths: list[DecodePath],
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    first_token: torch.Tensor,
    steps: int,
    rounds: int,
    progress: Callable[[str], None] = lambda line: None,
    control_malloc: bool = False,
    probe: ReadProbe | None = None,
    kv_bytes: int = 0,
) -> dict[str, PathTiming]:
    """Every path's steps at the prefilled length and at BASE_CONTEXT, one of each in turn (`paired_steps`), `rounds`
    times, the paths in alternating order, with `probe`'s read after each pair (each round's time to read the
    `kv_bytes` of keys and values once: its reads' median); then, untimed, the memory its steps at the prefilled
    length need (`step_peak_memory`)."""
    context = kv[0][0].shape[2]
    between = None if probe is None else probe.read_seconds
    timings = {path.name: PathTiming() for path in paths}
    for round_index in range(rounds):
        for path in paths if round_index % 2 == 0 else paths[::-1]:
            progress(f"round {round_index + 1}/{rounds}: {path.name}")
            timing = timings[path.name]
            cache, base_cache = filled_cache(path, kv, context, steps), filled_cache(path, kv, BASE_CONTEXT, steps)
            seconds, base_seconds, tokens, reads = paired_steps(path, cache, base_cache, first_token, steps, between)
            if reads:
                timing.round_reads.append(statistics.median(reads) * kv_bytes / probe.bytes)
            timing.long_steps.append(statistics.median(seconds))
            timing.base_steps.append(statistics.median(base_seconds))
            timing.round_costs.append(statistics.median(a - b for a, b in zip(seconds, base_seconds, strict=True)))
            timing.tokens = tokens if timing.tokens is None else timing.tokens
            timing.cache_bytes = cache_bytes(cache)
            del cache, base_cache
    for path in paths:
        progress(f"memory: {path.name}")
        timings[path.name].step_peak_bytes = step_peak_memory(path, kv, first_token, steps, control_malloc)
    return timings


def step_peak_memory(
    path: DecodePath,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    first_token: torch.Tensor,
    steps: int,
    control_malloc: bool = False,
) -> int:
    """The most memory above what its filled cache holds that a path's steps need at once. On CPU, with
    `control_malloc`, glibc returns freed large blocks to the system meanwhile (`returned_allocations`), so that the
    resident-memory peak counts what the steps allocate."""
    device = first_token.device
    with returned_allocations(control_malloc):
        cache = filled_cache(path, kv, kv[0][0].shape[2], steps)
        reset_peak_memory(device)
        before = memory_stats(device)["allocated"]
        timed_steps(path, cache, first_token, steps)
        return max(memory_stats(device)["max_allocated"] - before, 0)


@torch.no_grad()
def profiled_step(
    path: DecodePath, kv: list[tuple[torch.Tensor, torch.Tensor]], first_token: torch.Tensor, length: int, steps: int
) -> dict[str, float]:
    """Seconds per decode step by operator (self time, torch.profiler) at a context of `length` tokens, and the
    step's wall-clock time under the profiler (`STEP`): what no operator accounts for is Python."""
    from torch.profiler import ProfilerActivity, profile

    timed_steps(path, filled_cache(path, kv, length, steps), first_token, 2)  # warm
    cache = filled_cache(path, kv, length, steps)
    # The decode kernel is a C function, no operator: named here, or its time would count as Python's.
    annotated = _profiled_as(DECODE_KERNEL, dispatch.cpu_decode_sdpa)
    with (
        profile(activities=[ProfilerActivity.CPU]) as profiler,
        mock.patch.object(dispatch, "cpu_decode_sdpa", annotated),
    ):
        seconds, _ = timed_steps(path, cache, first_token, steps)
    operators = {event.key: event.self_cpu_time_total / 1e6 / steps for event in profiler.key_averages()}
    return {**operators, STEP: sum(seconds) / steps}


def _profiled_as(name: str, function: Callable) -> Callable:
    def annotated(*args, **kwargs):
        with torch.profiler.record_function(name):
            return function(*args, **kwargs)

    return annotated


# glibc's mallopt parameters, and the values its moving mmap threshold settles at (64-bit): large blocks reused.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
SETTLED_MMAP_THRESHOLD = 32 * MIB


def set_malloc_thresholds(mmap_threshold: int) -> bool:
    """Fix glibc's thresholds (heap blocks above `mmap_threshold` are mapped, and unmapped when freed); False where
    the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(M_TRIM_THRESHOLD, 2 * mmap_threshold))


@contextlib.contextmanager
def returned_allocations(control_malloc: bool) -> Iterator[None]:
    """Within: glibc gives freed blocks above 256 KiB back to the system, so that the resident set follows the
    tensors alive. After: the thresholds glibc settles at in a long run, under which the timings are taken. Only a
    process of the benchmark's own controls malloc (`control_malloc`: its thresholds are process-wide)."""
    if control_malloc:
        set_malloc_thresholds(256 * 1024)
    try:
        yield
    finally:
        if control_malloc:
            set_malloc_thresholds(SETTLED_MMAP_THRESHOLD)


__all__ = [
    "BASE_CONTEXT",
    "MIB",
    "PATHS",
    "PYTORCH_KERNEL",
    "REFERENCE",
    "SETTLED_MMAP_THRESHOLD",
    "STEP",
    "DecodePath",
    "PathTiming",
    "ReadProbe",
    "cache_bytes",
    "decode_paths",
    "absorbed_product_rate",
    "absorbed_products_per_token",
    "kv_bytes_per_token",
    "measure_shape",
    "prefill",
    "profiled_step",
    "prompt_ids",
    "set_malloc_thresholds",
]
