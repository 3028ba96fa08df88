"""run_lora_clm.py's Trainer: transformers' own, stopping at a non-finite loss and reporting what Optimum-Habana
users read in its logs (memory on every log line, next-token accuracy in evaluation).
"""

from typing import Any

import numpy as np
import torch
from transformers import EvalPrediction

from optimum.habana.transformers.context_parallel.trainer import ContextParallelTrainer
from optimum.habana.utils.devices import memory_stats, total_memory

from .data import IGNORE_INDEX


# Optimum-Habana's "(GB)" entries hold GiB (its to_gb_rounded divides by 1024³), as every script here reports memory.
GB = 1024**3


class NonFiniteLossError(RuntimeError):
    """The training loss became nan or inf: the weights are no longer worth saving."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"the training loss is {loss} at step {step}")
        self.step = step
        self.loss = loss


class FiniteLossTrainer(ContextParallelTrainer):
    """A Trainer that stops at the first non-finite training loss, before the optimizer applies that step, and logs
    the device's memory with every log line as Optimum-Habana's GaudiTrainer does.

    transformers' `logging_nan_inf_filter` (on by default) replaces such losses in the logs by the mean so far, so
    a diverged run otherwise finishes, reports a plausible loss and saves a nan adapter. With
    `context_parallel_size` above 1, each training sequence is split over that many processes.
    """

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not torch.isfinite(loss).all():
            raise NonFiniteLossError(self.state.global_step + 1, float(loss.detach().float().cpu()))
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # In place, as the Trainer's own log() adds "epoch": train() returns the dict it logged as its metrics.
        logs.update(memory_log_entries(self.args.device))
        super().log(logs, start_time)


def memory_log_entries(device: torch.device) -> dict[str, float]:
    """Optimum-Habana's memory entries, under its names, in GiB (on CPU: the resident set, its peak and the
    machine's memory)."""
    stats, total = memory_stats(device), total_memory(device)
    entries = {
        "memory_allocated (GB)": round(stats["allocated"] / GB, 2),
        "max_memory_allocated (GB)": round(stats["max_allocated"] / GB, 2),
    }
    if total is not None:
        entries["total_memory_available (GB)"] = round(total / GB, 2)
    return entries


def next_token_predictions(logits: torch.Tensor | tuple, labels: torch.Tensor) -> torch.Tensor:
    """Keep only the predicted token of every position: the logits of a whole evaluation set would not fit.

    An MoE model with its router loss on hands the Trainer a tuple (its aux loss, logits and router logits): the
    logits are the one tensor with a score per labelled position."""
    if isinstance(logits, tuple):
        logits = next(item for item in logits if isinstance(item, torch.Tensor) and item.shape[:-1] == labels.shape)
    return logits.argmax(dim=-1)


def next_token_accuracy(prediction: EvalPrediction) -> dict[str, Any]:
    """`eval_accuracy`: the share of labelled positions whose next token the model predicts (greedy)."""
    predictions = np.asarray(prediction.predictions)[:, :-1]
    labels = np.asarray(prediction.label_ids)[:, 1:]
    scored = labels != IGNORE_INDEX
    if not scored.any():
        return {}
    return {"accuracy": float((predictions[scored] == labels[scored]).mean())}
