"""Training with sequences split over processes (this package's `__init__`) in transformers' Trainer.

The world is `replicas x size` processes: consecutive ranks form one group that splits each sequence, and the groups
are data-parallel replicas of each other. Three pieces of glue, nothing else changes in the Trainer:

- the batches (`SplitBatches`): accelerate shards the training batches over all processes, as for data parallelism;
  each group then trains its processes' batches one after the other, every process on its part of each sequence
  (DeepSpeed's `UlyssesSPDataLoaderAdapter` order). With one replica that is one process's order of batches, and
  its epoch: accelerate's even batches are off for it (they fill the last round with the first examples again).
- the forward: `context_parallel=split` in the training forward, so that attention runs over the whole sequence.
- the loss: the model's loss of this process's positions, summed over the labelled tokens of all processes and
  divided by their count (transformers' `num_items_in_batch`, which the Trainer gathers over the processes and
  multiplies back by their number). Gradients averaged over all processes by DDP then equal one process's.
"""

import copy
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from transformers import DataCollatorWithFlattening, PreTrainedConfig, Trainer
from transformers.trainer_utils import unwrap_peft_model

from ... import hpu
from ...utils.distributed import gather_from_ranks
from . import ContextParallelError, SequenceSplit, check_heads, context_parallel_refusal, packed_batch_refusal


def check_context_parallel_model(
    config: PreTrainedConfig, size: int, name: str = "context_parallel_size", packed_by: str | None = None
) -> None:
    """Refuse a family or head count that cannot be split over `size` processes (ContextParallelError); `name` is
    the argument's, as the caller's user wrote it. `packed_by`: the option that packs the batches padding-free,
    where one is given: a family whose layers take no packed examples is refused by its name, before the weights
    load, for the reason its first step would give."""
    if size == 1:
        return
    reason = context_parallel_refusal(config)
    if reason is not None:
        raise ContextParallelError(f"{name} {size}: {reason}.")
    if packed_by is not None and (reason := packed_batch_refusal(config)) is not None:
        raise ContextParallelError(
            f"{packed_by} with {name} {size}: {reason}. Drop {packed_by}: each batch is then padded, which its split "
            "runs exactly."
        )
    try:
        check_heads(config, size)
    except ContextParallelError as error:
        raise ContextParallelError(f"{name} {size}: {error}") from None


def check_world_size(size: int, world_size: int, name: str = "context_parallel_size") -> None:
    """`size` processes per sequence, launched as whole groups (ContextParallelError otherwise)."""
    if size < 1:
        raise ContextParallelError(f"{name} must be at least 1, got {size}.")
    if size > 1 and world_size == 1:
        raise ContextParallelError(
            f"{name} {size} splits each sequence over {size} processes, and this is one process: launch {size} "
            f"(or a multiple, for data-parallel replicas), e.g. torchrun --nproc-per-node {size}."
        )
    if world_size % size:
        raise ContextParallelError(
            f"{name} {size} does not divide the {world_size} processes launched: launch a multiple of {size} "
            f"(replicas x {size})."
        )


def check_fused_kernel_everywhere(size: int, device: torch.device) -> None:
    """With the flag, every process must run the fused kernel: one without it would take the default path alone
    (exact, but its memory is the one the split was meant to avoid). A ContextParallelError names the processes."""
    problem = None
    if device.type == "hpu" and hpu.hpu_kernel() is None:
        problem = f"process {dist.get_rank()} cannot import the Gaudi software's FusedSDPA"
    problems = [message for message in gather_from_ranks(problem) if message is not None]
    if problems:
        raise ContextParallelError(
            f"use_flash_attention with context parallel size {size}: {'; '.join(problems)}. Install the Gaudi "
            "software on every node, or train without use_flash_attention."
        )


def split_of_this_process(size: int) -> SequenceSplit:
    """This process's `SequenceSplit`: the group of `size` consecutive ranks it belongs to.

    Every process creates every group (torch.distributed's rule for `new_group`); one group is the whole world."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    check_world_size(size, world_size)
    if size == world_size:
        return SequenceSplit.over()
    own = None
    for first in range(0, world_size, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            own = group
    return SequenceSplit.over(own)


class SplitBatches:
    """The training batches of a group's processes, in turn, each cut into this process's part (see the module).

    One group alone shards its processes' loaders without accelerate's even batches (replicas keep them): in the
    last round, a process whose shard holds one batch fewer hands in None and its turn is left out. Even batches would fill it with the first samples
    again (an epoch of 5 batches over 2 processes trained 6, and complete its last, smaller batch the same way), and
    the Trainer's schedule would count them: not one process's epoch. `length` is the group's batches in all."""

    def __init__(self, loader: Any, split: SequenceSplit, pad_token_id: int = 0, length: int | None = None) -> None:
        self.loader = loader
        self.split = split
        self.pad_token_id = pad_token_id
        self.length = len(loader) * split.size if length is None else length
        self.skip = 0  # batches of this order the next pass leaves out (a resumed epoch's trained ones)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[dict[str, Any]]:
        skip, self.skip = self.skip, 0
        own_batches = iter(self.loader)
        for index in itertools.count():  # every process runs the same rounds: each gathers, whether it has a batch
            batch = next(own_batches, None)
            if (index + 1) * self.split.size <= skip:  # every batch of this round was trained: not even gathered
                continue
            own = None
            if batch is not None:
                own = {
                    name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in batch.items()
                }
            batches: list[Any] = [None] * self.split.size
            dist.all_gather_object(batches, own, group=self.split.group)
            if all(whole is None for whole in batches):
                return
            for turn, whole in enumerate(batches):  # only the last round holds a None, after its batches
                if whole is not None and index * self.split.size + turn >= skip:
                    yield self.split.shard(whole, self.pad_token_id)

    def __getattr__(self, name: str) -> Any:  # set_epoch, the sampler, the dataset: the loader's own
        return getattr(self.loader, name)


def _read_parallelism_config(
    args: tuple[Any, ...], kwargs: dict[str, Any], size: int | None
) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """The context parallel size, from the argument or from accelerate's `parallelism_config.sp_size`.

    A `parallelism_config` asking for sequence parallelism is taken off a copy of the training arguments: with it,
    accelerate and the Trainer would set up DeepSpeed's Ulysses wrapper, which the Gaudi layers never call. Any other
    dimension in it (tensor, context or sharded data parallelism) is a ContextParallelError."""
    training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
    config = getattr(training_args, "parallelism_config", None)
    requested = (getattr(config, "sp_size", None) or 1) if config is not None else 1
    if requested == 1:
        return args, kwargs, size or 1
    others = {name: getattr(config, name, 1) or 1 for name in ("tp_size", "cp_size", "dp_shard_size")}
    if any(value > 1 for value in others.values()) or size not in (None, requested):
        raise ContextParallelError(
            f"parallelism_config asks for sequence parallelism over {requested} processes"
            + (f" and context_parallel_size is {size}" if size not in (None, requested) else "")
            + (f" beside {others}" if any(value > 1 for value in others.values()) else "")
            + ": ContextParallelTrainer splits sequences (sp_size) with data-parallel replicas only; pass one size."
        )
    copied = copy.copy(training_args)
    copied.parallelism_config = None
    if "args" in kwargs:
        kwargs = {**kwargs, "args": copied}
    else:
        args = (args[0], copied, *args[2:])
    return args, kwargs, requested


class ContextParallelTrainer(Trainer):
    """transformers' Trainer with each training sequence split over `context_parallel_size` processes.

    Launch `replicas x context_parallel_size` processes (torchrun, the DeepSpeed launcher); everything else is the
    Trainer's. Evaluation runs whole sequences on each process (data parallel). The size may also come the way
    accelerate documents it, `TrainingArguments(parallelism_config=ParallelismConfig(sp_size=N))`: this Trainer
    then splits the sequences itself (`_read_parallelism_config`).
    """

    def __init__(self, *args: Any, context_parallel_size: int | None = None, **kwargs: Any) -> None:
        args, kwargs, context_parallel_size = _read_parallelism_config(args, kwargs, context_parallel_size)
        super().__init__(*args, **kwargs)
        self.sequence_split: SequenceSplit | None = None
        if context_parallel_size == 1:
            return
        check_world_size(context_parallel_size, self.args.world_size)
        flattening = isinstance(self.data_collator, DataCollatorWithFlattening)  # padding-free packed batches
        packed_by = type(self.data_collator).__name__ if flattening else None
        check_context_parallel_model(self.model.config, context_parallel_size, packed_by=packed_by)
        if not self.args.average_tokens_across_devices:
            raise ContextParallelError(
                "context parallel training normalises the loss by the labelled tokens of all processes: leave "
                "average_tokens_across_devices at True."
            )
        if not self.model_accepts_loss_kwargs:
            raise ContextParallelError(
                f"context parallel training needs a model whose forward takes the loss's keyword arguments "
                f"(num_items_in_batch); {type(self.model).__name__}'s does not."
            )
        self.sequence_split = split_of_this_process(context_parallel_size)
        if getattr(unwrap_peft_model(self.model).generation_config, "use_flash_attention", False):
            check_fused_kernel_everywhere(context_parallel_size, self.args.device)

    def get_train_dataloader(self) -> Any:
        if self.sequence_split is None:
            return super().get_train_dataloader()
        # One group (no replica beside it): one process's epoch, see SplitBatches. Replicas keep accelerate's even
        # batches, as data parallelism does: each replica must take as many steps as the others (DDP's all-reduce).
        even_batches = self.accelerator.even_batches
        self.accelerator.even_batches = even_batches and self.args.world_size > self.sequence_split.size
        try:
            loader = super().get_train_dataloader()
        finally:
            self.accelerator.even_batches = even_batches
        lengths: list[Any] = [None] * self.sequence_split.size
        dist.all_gather_object(lengths, len(loader), group=self.sequence_split.group)
        pad_token_id = getattr(self.processing_class, "pad_token_id", None) or 0
        self._split_batches = SplitBatches(loader, self.sequence_split, pad_token_id, length=sum(lengths))
        return self._split_batches

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        # A resumed epoch's trained batches: the Trainer would skip them with accelerate's `skip_first_batches`,
        # which rebuilds the loader under SplitBatches, unsplit and counted in its own batches. SplitBatches skips
        # them itself, in its order.
        epochs_trained, trained_batches = super()._init_training_state(*args, **kwargs)
        if self.sequence_split is None or not trained_batches:
            return epochs_trained, trained_batches
        self._split_batches.skip = trained_batches
        return epochs_trained, 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.sequence_split is not None and model.training:
            inputs = {**inputs, "context_parallel": self.sequence_split}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


__all__ = [
    "ContextParallelTrainer",
    "SplitBatches",
    "check_context_parallel_model",
    "check_fused_kernel_everywhere",
    "check_world_size",
    "split_of_this_process",
]
