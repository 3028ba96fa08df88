"""What a Gaudi model's decoder decides about its batch once per forward, before the layers run.

Three layouts reach the fused kernel without transformers' dense mask (`optimum.habana.kernels.variable_length`):

- a padded prompt from an empty cache, with the flag (`PaddedPrompt`): causal over each row's real tokens;
- a padding-free packed batch (`Segments`): examples side by side in a row, position ids restarting at each one
  (transformers' `DataCollatorWithFlattening`, TRL's `padding_free`); each attends to itself alone;
- a continuous-batching step without the engine's mask (`Segments`): the requests of one step side by side.

Every plan is made before the layers, so that no layer reads a tensor on the host. Where reading is allowed (eager
on CPU or CUDA, `host_reads_allowed`), one read per forward makes the plan exact and cheap: where the padding lies,
or the sequences' bounds as Python numbers. Inside a graph (torch.compile, CUDA-graph capture) and on Gaudi, nothing
is read: the plan is tensors whose shapes do not depend on the data, so one graph serves every batch of the same
shapes. A caller that knows the padding says so with the forward argument `padding_side` (generate() reads it once
per call, before the graphed forwards, as Optimum-Habana computes its valid lengths before its HPU graphs). On Gaudi,
transformers' own masks are built here too, without their shortcuts, which read the mask on the host.
"""

from typing import Any, NamedTuple

import torch
from transformers import PreTrainedConfig
from transformers.masking_utils import (
    LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING,
    create_causal_mask,
    create_sliding_window_causal_mask,
)
from transformers.utils.import_utils import is_tracing

from ..kernels.dispatch import host_reads_allowed, needs_padding_mask, on_hpu, warn_once
from ..kernels.variable_length import PaddedPrompt, PromptPaddingSide, Segment, Segments
from .families.lookups import attention_with_its_own_mask, family_runs_mask_free, sequential_layers
from .families.qualification import ALTERNATING, CHUNKED, WINDOW
from .families.reports import family_report


PADDING_SIDES = ("none", "left", "right", "any")


class ReadPaddingSide(NamedTuple):
    """generate()'s reading of a prompt's padding side, with the length of the mask it read. A wrapper's own
    `prepare_inputs_for_generation` may change the mask after it (PEFT's prompt tuning prepends ones for its virtual
    tokens, which puts a left-padded row's padding in the middle): the decoder then finds another length, and plans
    from the mask it gets instead of the stale side."""

    side: PromptPaddingSide
    mask_length: int


def plan_batch_layout(config: PreTrainedConfig, kwargs: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The decoder keyword arguments that carry the plan (`padded_prompt`, `segments`, `segment_bounds`), and the
    attention mask that replaces the 2-D one where transformers must build none: a `[B, 1, 1, kv]` boolean mask of
    the real keys, which transformers passes through unchanged (it is 4-D) and the layers ignore for the plan.

    `kwargs` are the decoder's keyword arguments with the flags already resolved; `dtype` is the model's.
    """
    plan = _plan(config, kwargs)
    attention_mask = plan.get("attention_mask", kwargs.get("attention_mask"))
    if (
        is_padding_mask(attention_mask)
        and not is_tracing(attention_mask)
        and not host_reads_allowed(attention_mask)
        and masks_are_built_here(config)
    ):
        # On Gaudi, eager: transformers' mask shortcuts read the mask on the host (is it all ones?); build the masks
        # without them, before the layers, so that an HPU graph records no read.
        plan["attention_mask"] = masks_without_shortcuts(config, kwargs, dtype)
    return plan


def masks_are_built_here(config: PreTrainedConfig) -> bool:
    """Whether `masks_without_shortcuts` builds the masks the family's decoder would: it builds them with
    transformers' mask builders from the 2-D mask, which nothing else reads (OPT counts its positions from it), one
    builder per layer type (hybrid families' `hybrid` and `mlp` layers have none, or several), and its config's window
    is the one its layers apply (not Moshi's). Elsewhere the 2-D mask goes on to the family's own code, host reads and
    all, as stock's does."""
    layer_types = set(getattr(config, "layer_types", None) or ())
    builders = [LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.get(kind) for kind in layer_types]
    return (
        family_runs_mask_free(config.model_type)
        and generation_masks_are_the_familys(config)
        and all(callable(builder) for builder in builders)
    )


def _plan(config: PreTrainedConfig, kwargs: dict[str, Any]) -> dict[str, Any]:
    side = kwargs.pop("padding_side", None)
    if isinstance(side, ReadPaddingSide):
        mask = kwargs.get("attention_mask")
        side = side.side if is_padding_mask(mask) and mask.shape[-1] == side.mask_length else None
    if side is not None and side not in PADDING_SIDES:
        raise ValueError(f"`padding_side` must be one of {', '.join(map(repr, PADDING_SIDES))}, got {side!r}.")
    input_ids, inputs_embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    tokens = input_ids if input_ids is not None else inputs_embeds
    if tokens is None or tokens.dim() < 2:
        return {}
    attention_mask, cache = kwargs.get("attention_mask"), kwargs.get("past_key_values")
    if kwargs.get("cache") is not None:  # a continuous-batching step: the engine's paged cache
        # Its sequences, where a layer may run them without the engine's mask: every layer when the engine built
        # none, the full-attention layers beside sliding-window ones (`paged_attention.py`).
        planned = attention_mask is None or local_layers_run_planned(config)
        if kwargs["use_flash_attention"] and planned and host_reads_allowed(tokens):
            return {"segment_bounds": paged_bounds(kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))}
        return {}
    if attention_mask is None and cache is None and tokens.shape[1] > 1:
        if not can_run_packed(config):
            warn_if_states_cross_examples(config, kwargs, tokens)
            return {}
        segments = packed_segments(kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"), tokens)
        if segments is not None:
            placeholder = torch.ones(tokens.shape[0], 1, 1, tokens.shape[1], dtype=torch.bool, device=tokens.device)
            return {"segments": segments, "attention_mask": placeholder}
        return {}
    if not kwargs["use_flash_attention"] or not is_empty_cache_prompt(attention_mask, tokens.shape[1]):
        return {}
    causal_mask_mode = kwargs["flash_attention_causal_mask"]
    if not prompt_is_planned(config, tokens, causal_mask_mode):
        if causal_mask_mode:
            warn_once(
                f"flash_attention_causal_mask: {attention_with_its_own_mask(config.model_type)} makes its own mask "
                "from transformers' (what its layer adds: an indexer's selection, compressed blocks); its calls take "
                "that mask, not the rows' valid lengths."
            )
        return {}
    mask_free = prompt_runs_mask_free(config, tokens, causal_mask_mode)
    interior = False
    if side in (None, "any") and host_reads_allowed(attention_mask):  # "any" given: where, and whether in between
        side, interior = padding_layout(attention_mask)
    prompt = padded_prompt(attention_mask, side)
    if interior:
        # Padding between real tokens: a loss reads a padding position followed by a real token (it predicts that
        # token), in training and in evaluation alike, and stock gives it attention over the real keys before it
        # (PEFT's prompt tuning puts its virtual tokens there). transformers' mask gives every position stock's value.
        # Padding on both sides of a row's real tokens keeps the plan: no padding position there has a real key before
        # it and a real token after it.
        return {}
    if mask_free:  # transformers builds no mask: every layer runs the prompt causally over its real tokens
        return {"padded_prompt": prompt, "attention_mask": prompt.real[:, None, None, :]}
    return {"padded_prompt": prompt}  # windowed layers still read transformers' mask where the window is shorter


def prompt_runs_mask_free(config: PreTrainedConfig, tokens: torch.Tensor, causal_mask_mode: bool) -> bool:
    """Whether a padded prompt runs without transformers' mask on the fused path: every layer needs nothing but
    causality and the padding, or, off Gaudi, a window or chunk too (`kernels/local_attention.py`); and the device's
    kernel does not read the mask (Gaudi without the causal-mask mode)."""
    layers_plan_it = padding_mask_is_all_it_needs(config) or (not on_hpu(tokens) and local_layers_run_planned(config))
    return layers_plan_it and not needs_padding_mask(tokens, causal_mask_mode)


def prompt_is_planned(config: PreTrainedConfig, tokens: torch.Tensor, causal_mask_mode: bool) -> bool:
    """Whether a padded prompt from an empty cache is planned on the fused path: it runs mask-free, or the causal-mask
    mode gives the kernel the rows' valid lengths (layers with a window or chunk still read transformers' mask), unless
    the family's attention makes its own mask from the decoder's (an indexer's selection), which those would drop."""
    if causal_mask_mode and attention_with_its_own_mask(config.model_type) is None:
        return True
    return prompt_runs_mask_free(config, tokens, causal_mask_mode)


def generation_masks_are_the_familys(config: PreTrainedConfig) -> bool:
    """Whether the masks generate() builds for a static cache, from the config, are the ones the family's layers
    apply: a window or chunk in the config that no layer applies (Moshi keeps `sliding_window` for its cache) makes
    generate()'s mask windowed where the family's own is not, and stock attends through generate()'s."""
    local = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    if not local or getattr(config, "layer_types", None) is not None:
        return True
    return bool({WINDOW, ALTERNATING, CHUNKED} & set(family_report(config.model_type).variants))


def local_layers_run_planned(config: PreTrainedConfig) -> bool:
    """Whether every layer is causal attention, full, within a sliding window or within a chunk, and only the
    attention reads the masks: the layers then take a padded prompt's plan and apply their own window or chunk."""
    if not family_runs_mask_free(config.model_type) or not getattr(config, "is_causal", True):
        return False
    return set(getattr(config, "layer_types", None) or ()) <= {
        "full_attention",
        "sliding_attention",
        "chunked_attention",
    }


def is_empty_cache_prompt(attention_mask: Any, q_len: int) -> bool:
    """A prompt from an empty cache with a 2-D padding mask: the mask covers the new tokens only (transformers'
    masks cover the cached tokens too), so nothing is cached before them; no cache is read to know it."""
    return is_padding_mask(attention_mask) and attention_mask.shape[1] == q_len


def is_padding_mask(attention_mask: Any) -> bool:
    """A 2-D padding mask (transformers' masks are 4-D, or dicts of them by layer type)."""
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2


def masks_without_shortcuts(config: PreTrainedConfig, kwargs: dict[str, Any], dtype: torch.dtype) -> Any:
    """transformers' 4-D masks for the decoder's 2-D padding mask, keyed by layer type as the family reads them,
    built without the shortcuts that skip a mask of all ones (each shortcut reads the mask on the host)."""
    input_ids, inputs_embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    if inputs_embeds is None:  # the mask functions read the batch size, length, dtype and device only
        inputs_embeds = input_ids.new_empty((*input_ids.shape[:2], 0), dtype=dtype)
    arguments = {
        "config": config,
        "inputs_embeds": inputs_embeds,
        "attention_mask": kwargs["attention_mask"],
        "past_key_values": kwargs.get("past_key_values"),
        "position_ids": kwargs.get("position_ids"),
        "allow_is_causal_skip": False,
    }
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return {kind: LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING[kind](**arguments) for kind in set(layer_types)}
    if getattr(config, "sliding_window", None) is not None:
        return create_sliding_window_causal_mask(**arguments)
    return create_causal_mask(**arguments)


def padded_prompt(attention_mask: torch.Tensor, side: PromptPaddingSide | None = None) -> PaddedPrompt:
    """The prompt's real tokens and their count per row; the side as given, else read once, else "any"."""
    real = attention_mask.bool()
    lengths = real.sum(dim=-1, dtype=torch.int32)  # int32: FusedSDPA requires it, and compiled code keeps it
    if side is None:
        side = padding_side_of(real) if host_reads_allowed(real) else "any"
    return PaddedPrompt(real, lengths, side)


def padding_side_of(attention_mask: torch.Tensor) -> PromptPaddingSide:
    """Where a 2-D padding mask's padding lies: "none", "left", "right" or "any" (in the middle, or mixed). One
    host read."""
    return padding_layout(attention_mask)[0]


def padding_layout(attention_mask: torch.Tensor) -> tuple[PromptPaddingSide, bool]:
    """`padding_side_of`'s answer, and whether some row has padding between two of its real tokens (rather than
    on both sides of them), in the same host read."""
    real = attention_mask.bool()
    q_len = real.shape[1]
    positions = torch.arange(q_len, device=real.device)
    lengths = real.sum(dim=-1, keepdim=True)
    left = (real == (positions >= q_len - lengths)).all()
    right = (real == (positions < lengths)).all()
    first = real.int().argmax(dim=-1)
    last = q_len - 1 - real.flip(-1).int().argmax(dim=-1)
    spans = torch.where(real.any(dim=-1), last - first + 1, 0)
    interior = (spans != lengths[:, 0]).any()
    no_padding, is_left, is_right, has_interior = torch.stack([real.all(), left, right, interior]).tolist()
    if no_padding:
        return "none", False
    return ("left" if is_left else "right" if is_right else "any"), has_interior


def padding_mask_is_all_it_needs(config: PreTrainedConfig) -> bool:
    """Whether every layer's mask is causal plus padding (no sliding window, no bidirectional or chunked layers), and
    only the attention reads it (`FamilyReport.mask_free`: no indexer, no linear-attention layer reads it)."""
    if not family_runs_mask_free(config.model_type):
        return False
    if not getattr(config, "is_causal", True) or getattr(config, "attention_chunk_size", None):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(layer_type == "full_attention" for layer_type in layer_types)
    return getattr(config, "sliding_window", None) is None


def can_run_packed(config: PreTrainedConfig) -> bool:
    """Whether every layer's mask is causal, optionally windowed (what the packed attention reproduces per example),
    and only the attention reads it."""
    if not family_runs_mask_free(config.model_type):
        return False
    if not getattr(config, "is_causal", True) or getattr(config, "attention_chunk_size", None):
        return False
    layer_types = getattr(config, "layer_types", None) or ()
    return set(layer_types) <= {"full_attention", "sliding_attention"}


def warn_if_states_cross_examples(config: PreTrainedConfig, kwargs: dict[str, Any], tokens: torch.Tensor) -> None:
    """One line where a packed batch (position ids restarting in a row, no attention mask) reaches layers whose state
    runs along the sequence and nothing tells them the examples' bounds: each example's state carries into the next,
    silently in stock transformers too. One host read, where reading is allowed; none where bounds are given."""
    layers = sequential_layers(config)
    position_ids = kwargs.get("position_ids")
    bounds_given = any(kwargs.get(name) is not None for name in ("cu_seq_lens_q", "seq_idx"))
    if not layers or bounds_given or not isinstance(position_ids, torch.Tensor) or not host_reads_allowed(tokens):
        return
    if position_ids.shape[-1] > 1 and bool((torch.diff(position_ids, dim=-1) != 1).any()):
        warn_once(
            f"{config.model_type}: a packed batch (position ids restarting inside a row, no attention mask) reaches "
            f"its {', '.join(layers)} layers, whose state runs along the sequence: each example's state carries into "
            "the next (as in stock transformers), so its logits, loss and gradients are not those it gets alone. "
            "Pad the batch instead (with an attention mask)."
        )


def packed_segments(
    position_ids: torch.Tensor | None, cu_seq_lens_q: torch.Tensor | None, tokens: torch.Tensor
) -> Segments | None:
    """The examples of a padding-free packed batch, or None when the batch is not packed.

    Packed means no attention mask, no cache given (one the model builds itself is empty), and FlashAttention's
    `cu_seq_lens_q` (one row) or position ids that restart inside a row. On the host
    that is read once, and a batch whose position ids never restart is not packed; inside a graph any position ids
    are taken as a packing (one that never restarts is one example per row, which is the causal attention itself).
    """
    batch, length = tokens.shape[:2]
    positions = torch.arange(length, device=tokens.device)
    if isinstance(cu_seq_lens_q, torch.Tensor) and batch == 1:
        boundaries = cu_seq_lens_q.to(device=tokens.device, dtype=torch.long)
        ids = torch.searchsorted(boundaries[1:], positions, right=True)[None]
        starts = boundaries[ids.clamp(max=boundaries.shape[0] - 1)]
    elif isinstance(position_ids, torch.Tensor):
        restarts = torch.diff(position_ids.to(tokens.device).expand(batch, -1), dim=-1) != 1
        first = torch.ones(batch, 1, dtype=torch.bool, device=tokens.device)
        restarts = torch.cat([first, restarts], dim=-1)  # True where an example starts
        ids = restarts.cumsum(dim=-1) - 1
        starts = torch.cummax(torch.where(restarts, positions, 0), dim=-1).values
    else:
        return None
    example_positions = positions - starts
    bounds = None
    if host_reads_allowed(tokens):
        rows = ids.tolist()
        if all(row[-1] == 0 for row in rows):
            return None  # one example per row: not packed
        bounds = _bounds_of(rows)
    return Segments(ids, example_positions, ids, example_positions, bounds)


def _bounds_of(rows: list[list[int]]) -> tuple[Segment, ...]:
    segments = []
    for row, ids in enumerate(rows):
        start = 0
        for index in range(1, len(ids) + 1):
            if index == len(ids) or ids[index] != ids[start]:
                segments.append(Segment(row, start, index, start, index))
                start = index
    return tuple(segments)


def paged_bounds(cu_seq_lens_q: Any, cu_seq_lens_k: Any) -> tuple[Segment, ...] | None:
    """A continuous-batching step's sequences as Python numbers, from one read of the engine's boundaries."""
    if isinstance(cu_seq_lens_k, dict):  # by layer type; the mask-free step has full-attention layers only
        cu_seq_lens_k = cu_seq_lens_k.get("full_attention")
    if not isinstance(cu_seq_lens_q, torch.Tensor) or not isinstance(cu_seq_lens_k, torch.Tensor):
        return None
    count = cu_seq_lens_q.shape[0]
    if cu_seq_lens_k.shape[0] != count:
        return None
    both = torch.cat([cu_seq_lens_q, cu_seq_lens_k.to(cu_seq_lens_q.device)]).tolist()
    queries, keys = both[:count], both[count:]
    return tuple(
        Segment(0, queries[index], queries[index + 1], keys[index], keys[index + 1])
        for index in range(count - 1)
        if queries[index + 1] > queries[index]
    )


def paged_segments(
    cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor, query_length: int, key_length: int
) -> Segments:
    """A continuous-batching step's sequences as tensors (inside a graph): queries and keys past the last boundary
    (the engine pads its inputs to fixed sizes for graphs) belong to no sequence."""
    query_ids, query_offsets = _sequence_of(cu_seq_lens_q, query_length)
    key_ids, key_positions = _sequence_of(cu_seq_lens_k, key_length)
    sequence = query_ids.clamp(min=0)
    query_counts = cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]
    key_counts = cu_seq_lens_k[1:] - cu_seq_lens_k[:-1]
    # A sequence's queries are its last keys: the cached tokens come first.
    query_positions = query_offsets + (key_counts - query_counts).to(torch.long)[sequence]
    return Segments(query_ids[None], query_positions[None], key_ids[None], key_positions[None])


def _sequence_of(boundaries: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of `length` packed tokens: its sequence (-1 past the last boundary) and its offset in it."""
    boundaries = boundaries.to(torch.long)
    positions = torch.arange(length, device=boundaries.device)
    ids = torch.searchsorted(boundaries[1:], positions, right=True)
    last = boundaries.shape[0] - 1
    offsets = positions - boundaries[ids.clamp(max=last - 1)]
    return torch.where(ids < last, ids, -1), offsets


__all__ = [
    "PADDING_SIDES",
    "ReadPaddingSide",
    "can_run_packed",
    "generation_masks_are_the_familys",
    "is_empty_cache_prompt",
    "is_padding_mask",
    "local_layers_run_planned",
    "masks_without_shortcuts",
    "packed_segments",
    "padded_prompt",
    "padding_mask_is_all_it_needs",
    "padding_side_of",
    "paged_bounds",
    "paged_segments",
    "plan_batch_layout",
    "prompt_is_planned",
    "prompt_runs_mask_free",
]
