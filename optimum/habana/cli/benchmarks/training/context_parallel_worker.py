"""One training step of one long sequence split over the processes of a torchrun launch, measured on every process.

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m optimum.habana.cli.benchmarks.training.context_parallel_worker '<json task>'

`examples/language-modeling/benchmark_context_parallel.py` starts one launch per sequence length and process count.
Each process builds the model as `worker.py` does (fp32, the flag on, LoRA on the attention projections), takes its
part of the sequence (`SequenceSplit.shard`; one process takes it whole) and runs one forward + backward for the
memory, then `timed_steps` more; rank 0 prints the largest peak and extra memory of the processes and the slowest
step, on `RESULT_MARKER`'s line. A process that runs out of memory prints `"status": "oom"` itself.
"""

import json
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from optimum.habana.cli.benchmarks.training.worker import (
    CPU,
    MEMORY_STEP_MMAP_THRESHOLD,
    TIMED_STEP_MMAP_THRESHOLD,
    set_mmap_threshold,
    training_batch,
    training_model,
)
from optimum.habana.cli.benchmarks.workers import RESULT_MARKER, cap_address_space
from optimum.habana.cli.common import is_out_of_memory
from optimum.habana.transformers.context_parallel import SequenceSplit
from optimum.habana.utils.devices import memory_stats, reset_peak_memory


def split_step(model: torch.nn.Module, inputs: dict[str, Any]) -> None:
    model(**inputs).loss.backward()


def measure(task: dict[str, Any], split: SequenceSplit) -> dict[str, Any]:
    model = training_model({**task, "path": "flash", "mode": "lora"})
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batch = training_batch(1, task["tokens"], "none", model.config.vocab_size, pad, task["seed"])
    inputs: dict[str, Any] = batch
    if split.size > 1:
        inputs = split.shard(batch, pad)
        labelled = (inputs["shift_labels"] != -100).sum()
        dist.all_reduce(labelled, group=split.group)
        inputs = {**inputs, "context_parallel": split, "num_items_in_batch": labelled}
    if task.get("memory_limit_bytes"):
        cap_address_space(task["memory_limit_bytes"])
    set_mmap_threshold(MEMORY_STEP_MMAP_THRESHOLD)
    reset_peak_memory(CPU)
    resident = memory_stats(CPU)["allocated"]
    split_step(model, inputs)
    peak = memory_stats(CPU)["max_allocated"]
    set_mmap_threshold(TIMED_STEP_MMAP_THRESHOLD)
    times = []
    for _ in range(task["timed_steps"]):
        model.zero_grad(set_to_none=True)
        dist.barrier(group=split.group)
        start = time.perf_counter()
        split_step(model, inputs)
        dist.barrier(group=split.group)
        times.append(time.perf_counter() - start)
    return {"peak": peak, "extra": peak - resident, "seconds": min(times) if times else None}


def main(argv: list[str]) -> int:
    task = json.loads(argv[0])
    torch.set_num_threads(task["threads"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=task.get("timeout", 600)))
    split = SequenceSplit.over()
    try:
        measured = measure(task, split)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        line = {"status": "oom", "error": str(error).strip().splitlines()[0][:300], "rank": split.rank}
        print(RESULT_MARKER + json.dumps(line), flush=True)
        return 0
    every: list[Any] = [None] * split.size
    dist.all_gather_object(every, measured, group=split.group)
    if split.rank == 0:
        timed = [result["seconds"] for result in every if result["seconds"] is not None]
        seconds = max(timed) if timed else None  # --timed_steps 0: the memory step alone
        result = {
            "status": "ok",
            "peak_memory_bytes": max(result["peak"] for result in every),
            "extra_memory_bytes": max(result["extra"] for result in every),
            "step_seconds": seconds,
            "tokens_per_second": task["tokens"] / seconds if seconds else None,
        }
        print(RESULT_MARKER + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
