"""Sequences split over processes (context parallelism in DeepSpeed Ulysses' scheme) for a Gaudi model.

Each of the N processes of a group holds 1/N of every sequence's positions, and everything but attention runs on
those positions alone (embeddings, norms, MLPs, the LM head and the loss: memory per process falls as N grows).
Inside attention the split turns: an all-to-all hands every process the whole sequence for H/N of the heads, the
Gaudi attention runs on them, and a second all-to-all hands each process its own positions back for all heads.
So every per-head variant runs unchanged over the whole sequence (windows, sinks, chunks, latent attention,
per-layer head sizes), which ring attention would have to rewrite block by block. The one thing a layer computes
from the call's own positions before its attention function, Llama 4's NoPE layers' query temperature (counted
from the call's first token), is given each process's own positions there (`temperature_at_own_positions`).

The split reaches the layers as the forward argument `context_parallel` (a `SequenceSplit`), which transformers
hands from the decoder to every attention call with the other keyword arguments; nothing is stored on the model.
Before the layers, the decoder's plan (`batch_layout.py`) is made for the whole sequence from the gathered 2-D
padding mask and position ids (O(N) numbers): the real tokens of a padded batch, or the examples of a
padding-free packed one. The attention mask transformers builds is never materialised for the whole sequence.

The exchange is PyTorch's functional all-to-all (differentiable and traceable by torch.compile), on the process
group's backend: gloo on CPU, nccl on CUDA, hccl on Gaudi.
"""

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as collectives
from transformers import PreTrainedConfig

from ...kernels.dispatch import host_reads_allowed
from ..batch_layout import can_run_packed, local_layers_run_planned, packed_segments, padded_prompt, padding_side_of
from ..families.lookups import sequential_layers


IGNORE_INDEX = -100  # transformers' loss ignores these labels


class ContextParallelError(ValueError):
    """A model, a batch or a head count that cannot be split over the group exactly; the message says why."""


# Where DeepSpeed keeps the group of its own Ulysses wrapper (ALST), once set up.
DEEPSPEED_SEQUENCE_PARALLEL_STATE = "deepspeed.runtime.sequence_parallel.parallel_state_sp"


def check_no_foreign_split() -> None:
    """Refuse a forward under DeepSpeed's Ulysses wrapper (ALST, or accelerate's `sp_backend="deepspeed"`).

    It splits the batch, then wraps the attention function registered under the name the user chose ("sdpa"),
    which a Gaudi model's layers never call (they call the Gaudi attention): every process would attend over its
    own positions only, and train on wrong results without a word."""
    state = sys.modules.get(DEEPSPEED_SEQUENCE_PARALLEL_STATE)
    if state is not None and getattr(state, "_SEQUENCE_PARALLEL_GROUP", None) is not None:
        raise ContextParallelError(
            "DeepSpeed's Ulysses sequence parallelism is set up (ALST, or accelerate's ParallelismConfig("
            "sp_backend='deepspeed')): its wrapper of the 'sdpa' attention is never called by a Gaudi model's "
            "layers, so each process would attend over its own positions only. Split sequences with this library's "
            "ContextParallelTrainer (optimum.habana.transformers.context_parallel.trainer) or run_lora_clm.py "
            "--context_parallel_size instead."
        )


def context_parallel_refusal(config: PreTrainedConfig) -> str | None:
    """Why the family of `config` cannot be split over processes exactly, or None when it can (a family without a
    Gaudi class is refused where its model is built)."""
    model_type = config.model_type
    layer_types = set(getattr(config, "layer_types", None) or ())
    if sequential := sequential_layers(config):
        return (
            f"the model type {model_type!r} has {', '.join(sequential)} layers, whose state runs along the "
            "sequence: split over processes, it would restart at every process's first position"
        )
    if not getattr(config, "is_causal", True):
        return f"the model type {model_type!r} attends in both directions; only causal attention is split here"
    if not local_layers_run_planned(config):
        other = sorted(layer_types - {"full_attention", "sliding_attention", "chunked_attention"})
        if other:
            return f"the model type {model_type!r} has {', '.join(other)} layers, which are not split here"
        return (
            f"the model type {model_type!r} reads the attention mask outside its attention, where only this "
            "process's positions are"
        )
    return None


def packed_batch_refusal(config: PreTrainedConfig) -> str | None:
    """Why a padding-free packed batch of the family of `config` cannot be split, or None when it can: the plan
    takes packed examples only for layers that run them (`can_run_packed`). One reason for the first step and for
    the checks made before the weights load (`check_context_parallel_model`)."""
    if can_run_packed(config):
        return None
    chunked = getattr(config, "attention_chunk_size", None) or "chunked_attention" in (
        getattr(config, "layer_types", None) or ()
    )
    layers = "its chunked layers do" if chunked else "its layers do"
    return f"a padding-free packed batch of the model type {config.model_type!r}: {layers} not take packed examples"


def key_value_replication(heads: int, key_value_heads: int, size: int) -> int:
    """How many times each key/value head is repeated so that the heads split evenly over `size` processes.

    Exact: a query head's key/value head is the same after the repeat (each key/value head's query group is split
    into `factor` groups of equal size). A ContextParallelError names the heads and the size when no such repeat
    exists."""
    factor = _replication(heads, key_value_heads, size)
    if factor is None:
        sizes = [str(n) for n in range(2, heads + 1) if _replication(heads, key_value_heads, n) is not None]
        raise ContextParallelError(
            f"{heads} query heads over {key_value_heads} key/value heads cannot be split evenly over {size} "
            "processes (each process needs whole query heads beside their key/value heads): context parallel sizes "
            f"that split them: {', '.join(sizes[:8]) or 'none above 1'}."
        )
    return factor


def _replication(heads: int, key_value_heads: int, size: int) -> int | None:
    if heads % size or heads % key_value_heads:
        return None
    group = heads // key_value_heads
    return next(
        (factor for factor in range(1, group + 1) if group % factor == 0 and key_value_heads * factor % size == 0),
        None,
    )


def check_heads(config: PreTrainedConfig, size: int) -> None:
    """The config's head counts split over `size` processes (a ContextParallelError naming them otherwise)."""
    config = config.get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        return
    key_value_heads = getattr(config, "num_key_value_heads", None) or heads
    key_value_replication(heads, key_value_heads, size)


@dataclass(frozen=True)
class SequenceSplit:
    """One process's place in a group that splits every sequence: the group, its size and this process's rank.

    Pass it to the model's forward as `context_parallel=split`, with the batch `split.shard(batch)` gives this
    process. Every process of the group must run the same forward (the attention calls are collectives)."""

    group: Any  # a torch.distributed ProcessGroup
    size: int
    rank: int

    @classmethod
    def over(cls, group: Any = None) -> "SequenceSplit":
        """The split over `group` (the default group when None), as seen from this process."""
        group = dist.group.WORLD if group is None else group
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    # The batch ----------------------------------------------------------------------------------------------

    def shard(self, batch: Mapping[str, Any], pad_token_id: int = 0) -> dict[str, Any]:
        """This process's positions of a batch of whole sequences (`[batch, length]` tensors), ready for the forward.

        The labels are shifted before the cut (each position learns the next token, which may lie on the next
        process) and handed over as `shift_labels`, which transformers' causal-LM loss reads instead of shifting;
        position ids are those of the whole sequence (generated as 0, 1, ... when the batch has none). A length that
        `size` does not divide is padded at the end: padding tokens carry no label and no real token attends to them.
        """
        input_ids = batch["input_ids"]
        rows, length = input_ids.shape
        whole = dict(batch)
        if whole.get("position_ids") is None:
            whole["position_ids"] = torch.arange(length, device=input_ids.device).expand(rows, length)
        if whole.get("shift_labels") is None and whole.get("labels") is not None:
            whole["shift_labels"] = nn.functional.pad(whole["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        whole.pop("labels", None)
        padding = -length % self.size
        if padding:
            whole = _pad_sequences(whole, length, padding, pad_token_id)
        piece = (length + padding) // self.size
        part = slice(self.rank * piece, (self.rank + 1) * piece)
        local = {
            name: value[:, part].contiguous() if _is_per_position(value, rows, length + padding) else value
            for name, value in whole.items()
        }
        if "shift_labels" in local:
            local["labels"] = local["shift_labels"]  # transformers computes a loss only when labels are given
        return local

    # Before the layers ----------------------------------------------------------------------------------------

    def plan(self, config: PreTrainedConfig, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The decoder's plan for the whole sequence, from this process's part of it (see `batch_layout.py`)."""
        if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
            raise ContextParallelError(
                "context_parallel splits whole sequences in one forward (training, scoring): it takes no cache. Pass "
                "use_cache=False."
            )
        if kwargs.get("output_attentions"):
            raise ContextParallelError(
                "output_attentions with context_parallel: each process holds the weights of its own heads only; "
                "run without context_parallel to read them."
            )
        kwargs["use_cache"] = False
        position_ids = kwargs.get("position_ids")
        attention_mask = kwargs.get("attention_mask")
        if not isinstance(position_ids, torch.Tensor):
            raise ContextParallelError(
                "context_parallel needs this process's position ids of the whole sequence (`position_ids`): "
                "SequenceSplit.shard adds them to a batch."
            )
        if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
            raise ContextParallelError(
                "context_parallel takes a 2-D padding mask (or none); the whole sequence's masks are planned here."
            )
        positions = self.gather_positions(position_ids)
        if attention_mask is None:
            segments = packed_segments(positions, None, positions)
            if segments is not None:
                if (reason := packed_batch_refusal(config)) is not None:
                    raise ContextParallelError(f"{reason}. Pad the batch instead.")
                rows, length = positions.shape
                placeholder = torch.ones(rows, 1, 1, length, dtype=torch.bool, device=positions.device)
                return {"segments": segments, "attention_mask": placeholder}
            real = torch.ones_like(positions, dtype=torch.bool)
        else:
            real = self.gather_positions(attention_mask).bool()
        side = padding_side_of(real) if host_reads_allowed(real) else "any"
        prompt = padded_prompt(real, side)
        return {"padded_prompt": prompt, "attention_mask": prompt.real[:, None, None, :]}

    def gather_positions(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[batch, length / size]` from each process, as `[batch, length]` in the group's order."""
        return collectives.all_gather_single(tensor.contiguous(), gather_dim=1, group=self.group)

    # Inside the attention ---------------------------------------------------------------------------------------

    def attend(
        self,
        attention: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """`attention` over the whole sequence for this process's heads; returns `([B, q/N, H, Dv], None)` for
        query `[B, H, q/N, D]` and key/value `[B, Hkv, q/N, D]`, as the attention interface does."""
        heads, key_value_heads = query.shape[1], key.shape[1]
        try:
            factor = key_value_replication(heads, key_value_heads, self.size)
        except ContextParallelError as error:
            raise ContextParallelError(f"{type(module).__name__}: {error}") from None
        if factor > 1:
            key, value = key.repeat_interleave(factor, dim=1), value.repeat_interleave(factor, dim=1)
        for name in ("s_aux", "sinks"):  # one logit per head: this process's heads
            sinks = kwargs.get(name)
            if sinks is None:
                continue
            if sinks.dim() != 1:
                raise ContextParallelError(
                    f"{type(module).__name__} passes sinks of shape {tuple(sinks.shape)}; context_parallel splits "
                    "sinks of one logit per head only."
                )
            kwargs[name] = sinks.unflatten(0, (self.size, -1))[self.rank]
        query = temperature_at_own_positions(module, query, self.rank * query.shape[2])
        query, key, value = (self._heads_to_sequence(tensor) for tensor in (query, key, value))
        output, _ = attention(module, query, key, value, attention_mask, **kwargs)
        return self._sequence_to_heads(output), None

    def _heads_to_sequence(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[B, h, s, D]` (s of this process's positions) -> `[B, h / N, s * N, D]` (this process's heads)."""
        batch, heads, length, size = tensor.shape
        pieces = tensor.reshape(batch, self.size, heads // self.size, length, size).transpose(0, 1).contiguous()
        received = collectives.all_to_all_single_autograd(pieces, None, None, self.group)  # [N: positions, ...]
        return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // self.size, self.size * length, size)

    def _sequence_to_heads(self, output: torch.Tensor) -> torch.Tensor:
        """`[B, S, h / N, Dv]` (this process's heads) -> `[B, S / N, h, Dv]` (this process's positions)."""
        batch, length, heads, size = output.shape
        pieces = output.reshape(batch, self.size, length // self.size, heads, size).transpose(0, 1).contiguous()
        received = collectives.all_to_all_single_autograd(pieces, None, None, self.group)  # [N: heads, ...]
        return received.permute(1, 2, 0, 3, 4).reshape(batch, length // self.size, self.size * heads, size)


def temperature_at_own_positions(module: nn.Module, query: torch.Tensor, first: int) -> torch.Tensor:
    """`query` `[B, H, q, D]` of positions `first`, `first + 1`, ... with the attention temperature of those positions,
    where the module scaled it by that of positions 0, 1, ...

    Llama 4's layers without rotary embeddings (`attn_temperature_tuning and not use_rope`) scale each query before
    calling the attention function, by `log1p(floor((i + 1) / floor_scale)) * attn_scale + 1` with `i` counted from
    the call's first token (transformers' `Llama4TextAttention.forward`): on a process that holds positions from
    `first` on, that is the scale of the wrong positions. Each row is multiplied by scale(first + i) / scale(i)
    (scale >= 1, never 0), computed in the graph from the module's own numbers: no host read, no data-dependent branch.
    Any other module's query is returned as it is."""
    if first == 0 or not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    local = torch.arange(query.shape[2], device=query.device, dtype=torch.float32)

    def scale(positions: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((positions + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    ratio = scale(local + first) / scale(local)
    return (query * ratio[:, None]).to(query.dtype)


def _is_per_position(value: Any, rows: int, length: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (rows, length)


def _pad_sequences(batch: dict[str, Any], length: int, padding: int, pad_token_id: int) -> dict[str, Any]:
    """Every `[batch, length]` tensor padded by `padding` positions at the end: no label, masked out where a mask
    is given, and position ids that go on counting (padding after the last token, which nothing real attends to)."""
    rows = batch["input_ids"].shape[0]
    fill = {"input_ids": pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX}
    padded = {}
    for name, value in batch.items():
        if name == "position_ids":
            steps = torch.arange(1, padding + 1, device=value.device, dtype=value.dtype)
            padded[name] = torch.cat([value, value[:, -1:] + steps], dim=1)
        elif _is_per_position(value, rows, length) and value.dim() == 2:
            padded[name] = nn.functional.pad(value, (0, padding), value=fill.get(name, 0))
        else:
            padded[name] = value
    return padded


__all__ = [
    "ContextParallelError",
    "check_no_foreign_split",
    "SequenceSplit",
    "check_heads",
    "context_parallel_refusal",
    "key_value_replication",
    "packed_batch_refusal",
    "temperature_at_own_positions",
]
