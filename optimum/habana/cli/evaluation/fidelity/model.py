"""The model part of the fidelity table: a whole model's logits and perplexity on real text, per attention path.

The exact answer is the same model in float64 on the CPU, on the default path with its softmax in float64
(`attn_softmax_bf16=True` means "softmax in the model dtype"; without it the default path's softmax runs in fp32),
and with its RMSNorms computed in float64: transformers' RMSNorms cast their input to fp32 in every dtype, and a
float64 model whose norms round to fp32 is only exact to ~1e-5 in SmolLM2's logits (a 3e-14 relative change of
its weights moves them that much). The rotary angles stay as transformers computes them, in fp32 for every dtype:
the same values in every run, so part of the model, not an error. Each text segment runs once per model; a segment
that is both a logits length and a perplexity window serves both.
"""

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from optimum.habana.utils.devices import synchronize

from .attention import DEFAULT, DTYPES, FAST_SOFTMAX, FUSED, log


MODEL_PATHS = (DEFAULT, FUSED, FAST_SOFTMAX)


PATH_FLAGS = {
    DEFAULT: {},
    FUSED: {"use_flash_attention": True},
    FAST_SOFTMAX: {"use_flash_attention": True, "flash_attention_fast_softmax": True},
}


# The exact reference: float64 weights, default path, softmax in the model dtype (float64).
REFERENCE_FLAGS = {"attn_softmax_bf16": True}


class Float64RMSNorm(nn.Module):
    """`(offset + weight) * x / sqrt(mean(x^2) + eps)` in the input's dtype: an RMSNorm without the cast to fp32."""

    def __init__(self, weight: nn.Parameter, eps: float, offset: float) -> None:
        super().__init__()
        self.weight, self.eps, self.offset = weight, eps, offset

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return (self.offset + self.weight) * (hidden_states * torch.rsqrt(variance + self.eps))


def exact_norm(module: nn.Module, weight: nn.Parameter, eps: float) -> Float64RMSNorm | None:
    """The `Float64RMSNorm` that reproduces `module` on a random input (Llama's `weight` or Gemma's `1 + weight`)."""
    probe = torch.randn(3, weight.shape[-1], dtype=weight.dtype, generator=torch.Generator().manual_seed(0))
    for offset in (0.0, 1.0):
        candidate = Float64RMSNorm(weight, eps, offset)
        with torch.no_grad():
            if torch.allclose(candidate(probe), module(probe), rtol=1e-5, atol=1e-6):
                return candidate
    return None


def norms_in_float64(model: PreTrainedModel) -> dict[str, Any]:
    """Replace the float64 model's RMSNorms by `Float64RMSNorm`s that reproduce them; a norm no formula here
    reproduces is kept (in fp32) and its class named in the report."""
    replaced, kept = 0, set()
    for name, module in list(model.named_modules()):
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        weight = getattr(module, "weight", None)
        if not type(module).__name__.endswith("RMSNorm") or eps is None or weight is None:
            continue
        exact = exact_norm(module, weight, eps)
        if exact is None:
            kept.add(type(module).__name__)
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, exact)
        replaced += 1
    return {"rms_norms_in_float64": replaced, "norm_classes_kept": sorted(kept)}


@dataclass(frozen=True)
class Segment:
    """`length` tokens of the text from `start`, run as one prompt."""

    start: int
    length: int


def plan_segments(
    token_count: int, logit_lens: Sequence[int], ppl_window: int, ppl_tokens: int
) -> tuple[list[Segment], list[Segment]]:
    """The logits segments (the text's first L tokens, per L) and the perplexity windows (non-overlapping windows of
    `ppl_window` tokens over the first `ppl_tokens` tokens, 0 meaning all; a last window shorter than 2 is dropped)."""
    logits = [Segment(0, length) for length in logit_lens]
    span = token_count if ppl_tokens == 0 else min(ppl_tokens, token_count)
    windows = [Segment(start, min(ppl_window, span - start)) for start in range(0, span, ppl_window)]
    return logits, [window for window in windows if window.length >= 2]


def logits_of(model: PreTrainedModel, token_ids: torch.Tensor, flags: dict[str, bool]) -> torch.Tensor:
    """The prompt's logits `[L, vocab]` on the model's device, with the attention flags of one path."""
    device = model.device
    with torch.inference_mode():
        logits = model(input_ids=token_ids[None].to(device), use_cache=False, **flags).logits[0]
    synchronize(device)
    return logits


def negative_log_likelihood(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The negative log-likelihood of each of tokens 1..L-1 given its prefix, in float64 on the CPU."""
    log_probabilities = torch.log_softmax(logits[:-1].to("cpu", torch.float64), dim=-1)
    return -log_probabilities.gather(1, token_ids[1:, None].cpu())[:, 0]


def logits_errors(logits: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    """Max and mean absolute error of the logits over every position and vocabulary entry."""
    difference = (logits.to("cpu", torch.float64) - reference).abs()
    if not bool(torch.isfinite(difference).all()):
        return {"status": "non-finite", "reason": "the logits hold NaN or infinity"}
    return {"status": "ok", "max_abs_error": difference.max().item(), "mean_abs_error": difference.mean().item()}


def model_path_applies(path: str, device: torch.device) -> str | None:
    if path == FAST_SOFTMAX and device.type != "hpu":
        return f"n/a on {device.type}"
    return None


def measure_segment(
    segment: Segment,
    token_ids: torch.Tensor,
    reference_model: PreTrainedModel,
    models: dict[str, PreTrainedModel],
    device: torch.device,
) -> dict[str, Any]:
    """The reference and every dtype and path on one segment: logits errors, log-likelihood and seconds."""
    ids = token_ids[segment.start : segment.start + segment.length]
    started = time.perf_counter()
    reference = logits_of(reference_model, ids, REFERENCE_FLAGS).to(torch.float64)
    record: dict[str, Any] = {
        "start": segment.start,
        "length": segment.length,
        "predicted_tokens": segment.length - 1,
        "reference": {
            "nll_sum": negative_log_likelihood(reference, ids).sum().item(),
            "seconds": time.perf_counter() - started,
        },
        "dtypes": {},
    }
    for dtype, model in models.items():
        record["dtypes"][dtype] = {}
        default_nll = None
        for path in MODEL_PATHS:
            reason = model_path_applies(path, device)
            if reason is not None:
                record["dtypes"][dtype][path] = {"status": "n/a", "reason": reason}
                continue
            started = time.perf_counter()
            logits = logits_of(model, ids, PATH_FLAGS[path])
            seconds = time.perf_counter() - started
            result = logits_errors(logits, reference)
            if result["status"] == "ok":
                nll = negative_log_likelihood(logits, ids)
                result["nll_sum"] = nll.sum().item()
                if path == DEFAULT:
                    default_nll = nll
                elif default_nll is not None:  # for the paired standard error of the perplexity change
                    result["nll_difference_square_sum"] = (nll - default_nll).square().sum().item()
            record["dtypes"][dtype][path] = {**result, "seconds": seconds}
            del logits
            log(f"[model] {dtype} {path} tokens {segment.start}-{segment.start + segment.length}: {seconds:.1f} s")
    return record


def reference_check(model: PreTrainedModel, token_ids: torch.Tensor) -> dict[str, Any]:
    """How exact the reference is: the float64 model's other two runs against it on one short segment.

    The fused kernel accumulates in float64 (agreement ~1e-12 or better says both are exact); the default path
    without the flag computes its softmax in fp32 (the reason the reference sets the flag).
    """
    reference = logits_of(model, token_ids, REFERENCE_FLAGS).to(torch.float64)
    return {
        "tokens": len(token_ids),
        "fp64_fused": logits_errors(logits_of(model, token_ids, PATH_FLAGS[FUSED]), reference),
        "fp64_default_fp32_softmax": logits_errors(logits_of(model, token_ids, PATH_FLAGS[DEFAULT]), reference),
    }


def perplexities(records: Sequence[dict[str, Any]], windows: Sequence[Segment]) -> dict[str, Any]:
    """exp(mean negative log-likelihood) over the perplexity windows, for the reference and each dtype and path."""
    chosen = [record for record in records if Segment(record["start"], record["length"]) in set(windows)]
    predicted = sum(record["predicted_tokens"] for record in chosen)

    def perplexity(values: list[float]) -> float:
        return float(torch.tensor(sum(values) / predicted, dtype=torch.float64).exp())

    result: dict[str, Any] = {"reference": perplexity([record["reference"]["nll_sum"] for record in chosen])}
    standard_errors: dict[str, dict[str, float]] = {}
    for dtype in chosen[0]["dtypes"] if chosen else ():
        result[dtype] = {}
        for path in MODEL_PATHS:
            entries = [record["dtypes"][dtype][path] for record in chosen]
            if all(entry.get("status") == "ok" for entry in entries):
                result[dtype][path] = perplexity([entry["nll_sum"] for entry in entries])
            else:
                result[dtype][path] = next(
                    entry.get("reason", entry["status"]) for entry in entries if entry["status"] != "ok"
                )
            if all("nll_difference_square_sum" in entry for entry in entries):
                defaults = [record["dtypes"][dtype][DEFAULT]["nll_sum"] for record in chosen]
                mean = (sum(entry["nll_sum"] for entry in entries) - sum(defaults)) / predicted
                square = sum(entry["nll_difference_square_sum"] for entry in entries) / predicted
                standard_errors.setdefault(dtype, {})[path] = math.sqrt(max(square - mean**2, 0.0) / predicted)
    return {
        "predicted_tokens": predicted,
        "windows": len(chosen),
        "perplexity": result,
        # Per path: the standard error of its mean per-token log-likelihood difference to the default path (paired,
        # tokens taken as independent), which is also the standard error of the relative perplexity change.
        "change_standard_error": standard_errors,
    }


def measure_model(
    load: Callable[[torch.dtype, torch.device], PreTrainedModel],
    device: torch.device,
    token_ids: torch.Tensor,
    dtypes: Sequence[str],
    logit_lens: Sequence[int],
    ppl_window: int,
    ppl_tokens: int,
    on_update: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Logits errors at each of `logit_lens` and the perplexity over the windows, per dtype and path.

    `load(dtype, device)` loads the model as a user does in that dtype (`from_pretrained(dtype=...)`; a cast with
    `model.to(dtype)` would also round the rotary frequencies, which `from_pretrained` keeps in fp32). The float64
    reference runs on the CPU (float64 is slow or missing on accelerators), each dtype on `device`. `on_update`
    gets the partial result after each segment.
    """
    logit_segments, windows = plan_segments(len(token_ids), logit_lens, ppl_window, ppl_tokens)
    reference_model = load(torch.float64, torch.device("cpu"))
    norms = norms_in_float64(reference_model)
    models = {dtype: load(DTYPES[dtype], device) for dtype in dtypes}
    shortest = min(logit_segments + windows, key=lambda segment: segment.length)
    result: dict[str, Any] = {
        "reference_norms": norms,
        "reference_check": reference_check(reference_model, token_ids[: shortest.length]),
        "logit_lens": list(logit_lens),
        "ppl_window": ppl_window,
        "ppl_tokens": ppl_tokens,
        "segments": [],
    }
    for segment in dict.fromkeys(logit_segments + windows):  # each distinct segment once, in order
        result["segments"].append(measure_segment(segment, token_ids, reference_model, models, device))
        on_update(result)
    result["perplexity"] = perplexities(result["segments"], windows)
    on_update(result)
    return result
