"""benchmark_long_context_decode.py's continuous-batching rows: decode steps through transformers' engine and its
paged cache, from the same prompts the other rows prefill.

Each path serves the shape's prompts (one request per sequence, the same token ids as the other rows' prefill) through
`generate_batch` for one token from the prompts (all in the engine's first step) and `--steps` decode steps after it. A step is timed from one engine
forward to the next while every request decodes (the engine's own work between forwards included: it is the cost of
a token there), at the long context and at BASE_CONTEXT tokens (the prompts' first tokens), `--rounds` times in
alternating order, medians. The paths:

- the flag, its decode rows reading the paged cache in place (`transformers/paged_attention.py`);
- the flag on the engine's gather (what its steps did before: each sequence's cache copied per layer and step, then
  the decode kernel over the copy);
- stock transformers with SDPA through the same engine.
"""

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from optimum.habana.cli.benchmarks.long_context_decode import BASE_CONTEXT, DecodePath, PathTiming
from optimum.habana.transformers import paged_attention


IN_PLACE = "flag, continuous batching"
GATHERED = "flag, continuous batching, engine's gather"
STOCK = "stock sdpa, continuous batching"
# Each path's whole step is compared with this one's, same shape, same run.
REFERENCE = {IN_PLACE: STOCK, GATHERED: STOCK}
PAGE_SIZE = 256


@dataclass(frozen=True)
class EnginePath:
    name: str
    model: torch.nn.Module
    flags: dict[str, Any]
    in_place: bool = True  # the flag's decode rows read the paged cache in place (off: the engine gathers it)


def engine_paths(paths: list[DecodePath]) -> list[EnginePath]:
    """The engine's paths over the dense rows' models: this library's, and stock transformers' with SDPA."""
    models = {path.name: path.model for path in paths}
    flag = {"use_flash_attention": True}
    return [
        EnginePath(IN_PLACE, models["flag"], flag),
        EnginePath(GATHERED, models["flag"], flag, in_place=False),
        EnginePath(STOCK, models["stock sdpa"], {}),
    ]


def check_positions(model: torch.nn.Module, context: int, steps: int) -> str | None:
    """The engine refuses a request past the model's `max_position_embeddings`, which the other rows' steps go past
    at a context as long as it: raised for this run where the rotary embedding does not depend on it (default RoPE),
    with the line to print; otherwise an error naming the longest context the rows can use."""
    config = model.config
    needed, positions = context + steps + 1, getattr(config, "max_position_embeddings", None)
    if positions is None or needed <= positions:
        return None
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"--continuous_batching: the engine refuses {context} + {steps + 1} positions past the model's "
            f"{positions} (max_position_embeddings), and its {rope_type} RoPE depends on that value: use contexts "
            f"of at most {positions - steps - 1} tokens."
        )
    config.max_position_embeddings = needed
    return (
        f"continuous batching: max_position_embeddings raised from {positions} to {needed} for this run, so that the "
        f"engine takes {context} prompt tokens and {steps + 1} new ones (default RoPE: the embedding is unchanged)"
    )


@torch.no_grad()
def engine_steps(path: EnginePath, prompts: list[list[int]], steps: int) -> tuple[list[float], torch.Tensor]:
    """Seconds of each step in which every request decodes (to the next step's start), and each request's tokens
    after its first (`[B, steps]`, as the dense rows decode from the prompt's first token)."""
    starts: list[tuple[float, int]] = []

    def started(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        starts.append((time.perf_counter(), kwargs["input_ids"].numel()))

    config = GenerationConfig(max_new_tokens=steps + 1, do_sample=False, eos_token_id=-1, pad_token_id=0, **path.flags)
    pages = len(prompts) * -(-(len(prompts[0]) + steps + 1) // PAGE_SIZE)
    # Every prompt in the first step, as the other rows prefill them: then every request decodes at every step.
    prompt_tokens = sum(len(prompt) for prompt in prompts)
    engine = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=pages + 1, max_batch_tokens=prompt_tokens)
    hook = path.model.register_forward_pre_hook(started, with_kwargs=True)
    with contextlib.ExitStack() as settings:
        if not path.in_place:
            settings.enter_context(mock.patch.object(paged_attention, "paged_decode_applies", lambda *_: False))
        try:
            outputs = path.model.generate_batch(prompts, generation_config=config, continuous_batching_config=engine)
        finally:
            hook.remove()
    ordered = sorted(outputs.values(), key=lambda output: int(output.request_id.rsplit("_", 1)[-1]))
    if any(len(output.generated_tokens) != steps + 1 for output in ordered):
        raise RuntimeError(f"{path.name}: a request ended before {steps + 1} tokens: {ordered}")
    batch = len(prompts)
    seconds = [
        after - before for (before, tokens), (after, _) in zip(starts, starts[1:], strict=False) if tokens == batch
    ]
    if not seconds:
        raise RuntimeError(f"{path.name}: no step had every request decoding (and a step after it): raise --steps")
    return seconds, torch.tensor([output.generated_tokens[1:] for output in ordered])


def measure_engine_shape(
    paths: list[EnginePath],
    prompt_ids: torch.Tensor,
    steps: int,
    rounds: int,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, PathTiming]:
    """Every path's decode steps at the prompts' length and at BASE_CONTEXT, `rounds` times in alternating order."""
    long_prompts, base_prompts = prompt_ids.tolist(), prompt_ids[:, :BASE_CONTEXT].tolist()
    timings = {path.name: PathTiming() for path in paths}
    for round_index in range(rounds):
        for path in paths if round_index % 2 == 0 else paths[::-1]:
            progress(f"round {round_index + 1}/{rounds}: {path.name}")
            timing = timings[path.name]
            seconds, tokens = engine_steps(path, long_prompts, steps)
            timing.long_steps.append(statistics.median(seconds))
            timing.tokens = tokens if timing.tokens is None else timing.tokens
            timing.base_steps.append(statistics.median(engine_steps(path, base_prompts, steps)[0]))
            timing.round_costs.append(timing.long_steps[-1] - timing.base_steps[-1])  # the engine's runs in turn
    return timings


__all__ = [
    "GATHERED",
    "IN_PLACE",
    "PAGE_SIZE",
    "REFERENCE",
    "STOCK",
    "EnginePath",
    "check_positions",
    "engine_paths",
    "engine_steps",
    "measure_engine_shape",
]
