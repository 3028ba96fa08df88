"""One training-step measurement in a fresh process, so that its peak memory belongs to it alone.

    python -m optimum.habana.cli.benchmarks.training.worker '<json task>'

`examples/language-modeling/benchmark_training.py` starts one per row and path and reads the last stdout line,
`RESULT_MARKER` followed by the JSON result. The worker builds the model in fp32 (`benchmarks.models.build_model`,
the flag on for the `flash` path), adds LoRA adapters on the attention projections (`finetuning.modeling.add_lora`) or
trains every weight, turns gradient checkpointing on when asked, and runs forward + backward steps on one random
batch: the first for the memory, the next `timed_steps` for the time (the fastest counts: on a shared machine a
step slowed by another process is the noise, not the measurement). There is no optimizer step: the optimizer's
state depends on the trainable weights only, so it is the same for every path and tells nothing about attention.

Resident memory follows the live tensors only if freed memory goes back to the system: glibc's malloc keeps freed
blocks below its mmap threshold (which it raises on its own up to 32 MiB) in its heap, where they fragment, and
identical runs then differ by several percent of their extra memory (0.12 GiB of 2 at 4096 tokens on SmolLM2's
geometry), on every path alike. The memory step therefore runs with the threshold fixed at 128 KiB (every tensor
larger than that gets its own mapping, unmapped when freed), the timed steps with it at 32 MiB, where glibc's own
adjustment settles in a training loop. Elsewhere than glibc nothing changes.

The address space is capped at `memory_limit_bytes` beyond the process's size just before the first step, so that
a step that needs more fails with an allocation error, reported as `"status": "oom"`, instead of waking the
kernel's OOM killer on a shared machine (which the parent reports as OOM too).
"""

import ctypes
import json
import sys
import time
from typing import Any

import torch

from optimum.habana.cli.benchmarks.models import ModelSpec, build_model
from optimum.habana.cli.benchmarks.workers import cap_address_space, report_measurement
from optimum.habana.cli.finetuning.modeling import add_lora, lora_config
from optimum.habana.utils.devices import memory_stats, reset_peak_memory


CPU = torch.device("cpu")


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


MEMORY_STEP_MMAP_THRESHOLD = 128 << 10


TIMED_STEP_MMAP_THRESHOLD = 32 << 20


# Every second row of a padded batch is this fraction of the length: short enough that the mask matters.
PADDED_ROW_FRACTION = 0.75


def training_batch(
    batch_size: int, tokens: int, padding: str, vocab_size: int, pad_token_id: int, seed: int
) -> dict[str, torch.Tensor]:
    """Random token ids, labels equal to them; with `padding` ("left"/"right") every second row is shorter and
    padded on that side, its padding masked out and left out of the loss."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab_size, (batch_size, tokens), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if padding != "none":
        pad = tokens - int(tokens * PADDED_ROW_FRACTION)
        columns = slice(None, pad) if padding == "left" else slice(tokens - pad, None)
        input_ids[1::2, columns] = pad_token_id
        attention_mask[1::2, columns] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def training_model(task: dict[str, Any]) -> torch.nn.Module:
    """The model of one path, ready to train as the row says (LoRA or every weight, checkpointing or not)."""
    model = build_model(ModelSpec(**task["model"]), task["path"], torch.float32, task["seed"])
    if task["path"] == "flash":
        model.generation_config.use_flash_attention = True
    model.config.use_cache = False  # training: no key/value cache to fill
    if task["gradient_checkpointing"]:
        model.activation_checkpointing_enable()  # non-reentrant: LoRA's frozen inputs need no grad hook
    if task["mode"] == "lora":
        model = add_lora(model, lora_config(rank=8, alpha=16, dropout=0.0))
    else:
        model.requires_grad_(True)
    return model.train()


def set_mmap_threshold(size: int) -> bool:
    """Allocations above `size` bytes get their own mapping, returned to the system when freed (glibc only)."""
    try:
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, size))
    except (OSError, AttributeError):
        return False


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """One forward + backward; returns the loss, so that a non-finite one is seen."""
    loss = model(**batch).loss
    loss.backward()
    return loss.item()


def measure_training(task: dict[str, Any]) -> dict[str, Any]:
    """Build, then one step for the peak memory and `timed_steps` more, timed; the fastest is the step time."""
    model = training_model(task)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batch = training_batch(
        task["batch_size"], task["tokens"], task["padding"], model.config.vocab_size, pad, task["seed"]
    )
    real_tokens = int(batch["attention_mask"].sum())
    if task.get("memory_limit_bytes"):
        cap_address_space(task["memory_limit_bytes"])
    fixed_threshold = set_mmap_threshold(MEMORY_STEP_MMAP_THRESHOLD)
    reset_peak_memory(CPU)
    resident = memory_stats(CPU)["allocated"]
    loss = step(model, batch)
    peak = memory_stats(CPU)["max_allocated"]
    set_mmap_threshold(TIMED_STEP_MMAP_THRESHOLD)
    times = []
    for _ in range(task.get("timed_steps", 1)):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step(model, batch)
        times.append(time.perf_counter() - start)
    seconds = min(times)
    return {
        "status": "ok",
        "step_seconds": seconds,
        "step_times": times,
        "tokens_per_second": real_tokens / seconds,
        "real_tokens": real_tokens,
        "peak_memory_bytes": peak,
        "resident_before_bytes": resident,
        "extra_memory_bytes": peak - resident,
        "fixed_mmap_threshold": fixed_threshold,
        "loss": loss,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def main(argv: list[str]) -> int:
    return report_measurement(measure_training, json.loads(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
