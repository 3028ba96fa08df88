"""One serving measurement in a fresh process, so that its peak memory belongs to it alone.

    python -m optimum.habana.cli.benchmarks.continuous_batching.worker '<json task>'

`examples/text-generation/benchmark_continuous_batching.py` starts one per path and repeat, and reads the last
stdout line (`RESULT_MARKER` + JSON). Every path serves the same requests (token slices of the shipped long text,
of the task's lengths) for the same number of new tokens each, end-of-sequence ignored, greedy, in fp32:

- `cb_flash`, `cb_default`: the Gaudi class through transformers' continuous batching (`generate_batch`), with
  the flag on / off;
- `stock_cb_sdpa`: the stock class with `attn_implementation="sdpa"` through the same engine, same cache geometry;
- `static_flash`: the Gaudi class with the flag through `generate()`, in consecutive left-padded batches of
  `static_batch_size` requests, in submission order.

A small warm-up request runs first (allocator and kernel first-use costs out of the measurement).
"""

import hashlib
import json
import sys
import time
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from optimum.habana.cli.benchmarks.workers import report_measurement
from optimum.habana.cli.common import LONG_PROMPT_PATH
from optimum.habana.cli.generation.continuous_batching import engine_config
from optimum.habana.transformers import gaudi_model_class
from optimum.habana.utils.devices import memory_stats, reset_peak_memory
from optimum.habana.utils.model_loading import resolve_model
from optimum.habana.utils.pretrained import load_tokenizer


CPU = torch.device("cpu")


PATHS = ("cb_flash", "cb_default", "stock_cb_sdpa", "static_flash")


WARMUP_REQUEST = {"prompt_tokens": 16, "new_tokens": 4}


def request_tokens(tokenizer: Any, lengths: list[int]) -> list[list[int]]:
    """Consecutive slices of the shipped long text, one per request, of the given lengths."""
    text_ids = tokenizer(LONG_PROMPT_PATH.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    requests, start = [], 0
    for length in lengths:
        if start + length > len(text_ids):
            start = 0
        requests.append(text_ids[start : start + length])
        start += length
    return requests


def load(path: str, checkpoint: str) -> torch.nn.Module:
    if path == "stock_cb_sdpa":
        return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
    model_class = gaudi_model_class(AutoConfig.from_pretrained(checkpoint).model_type)
    return model_class.from_pretrained(checkpoint, dtype=torch.float32).eval()


def greedy_config(path: str, new_tokens: int, pad_token_id: int) -> GenerationConfig:
    values = {"max_new_tokens": new_tokens, "do_sample": False, "eos_token_id": [], "pad_token_id": pad_token_id}
    if path != "stock_cb_sdpa":
        values["use_flash_attention"] = path != "cb_default"
    return GenerationConfig(**values)


class RequestsFailed(RuntimeError):
    """Requests the engine answered with an error: the path's measurement would be of fewer tokens."""


def serve_continuously(model: Any, requests: list[list[int]], config: GenerationConfig, task: dict) -> list[list[int]]:
    engine = engine_config([len(ids) for ids in requests], config.max_new_tokens, task["max_batch_tokens"])
    outputs = model.generate_batch(inputs=requests, generation_config=config, continuous_batching_config=engine)
    failed = [output for output in outputs.values() if output.error is not None]
    if failed:
        raise RequestsFailed(f"{len(failed)} of {len(requests)} requests failed; the first: {failed[0].error}")
    return [list(output.generated_tokens) for output in outputs.values()]


def serve_in_static_batches(
    model: Any, requests: list[list[int]], config: GenerationConfig, task: dict
) -> list[list[int]]:
    generated = []
    size = task["static_batch_size"]
    for first in range(0, len(requests), size):
        batch = requests[first : first + size]
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), config.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        generated += output[:, width:].tolist()
    return generated


def measure(task: dict[str, Any]) -> dict[str, Any]:
    path = task["path"]
    resolved = resolve_model(task.get("model"))
    tokenizer = load_tokenizer(resolved)
    model = load(path, str(resolved.path))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    config = greedy_config(path, task["max_new_tokens"], pad)
    requests = request_tokens(tokenizer, task["prompt_lengths"])
    serve = serve_in_static_batches if path == "static_flash" else serve_continuously
    # No inference_mode: the engine's worker thread updates tensors made here in place, which it forbids.
    warmup = request_tokens(tokenizer, [WARMUP_REQUEST["prompt_tokens"]])
    serve(model, warmup, greedy_config(path, WARMUP_REQUEST["new_tokens"], pad), task)
    resident = memory_stats(CPU)["allocated"]
    reset_peak_memory(CPU)
    start = time.perf_counter()
    try:
        generated = serve(model, requests, config, task)
    except RequestsFailed as error:
        return {"status": "error", "error": str(error)}
    seconds = time.perf_counter() - start
    new_tokens = sum(len(tokens) for tokens in generated)
    expected = len(requests) * task["max_new_tokens"]
    if new_tokens != expected:  # a failed request would make the path look fast
        return {"status": "error", "error": f"{new_tokens} new tokens instead of {expected}: requests failed"}
    peak = memory_stats(CPU)["max_allocated"]
    return {
        "status": "ok",
        "seconds": seconds,
        "new_tokens": new_tokens,
        "throughput_tokens_per_second": new_tokens / seconds,
        "peak_memory_bytes": peak,
        "extra_memory_bytes": max(0, peak - resident),
        "tokens_sha256": hashlib.sha256(json.dumps(generated).encode()).hexdigest()[:16],
    }


def main(argv: list[str]) -> int:
    return report_measurement(measure, json.loads(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
