"""The dense masks of a batch's plan, for the calls that read one.

The decoder plans a padded prompt or a packed batch once (`batch_layout`) and hands the layers that plan instead of
transformers' `[B, 1, q, kv]` masks. The fused path runs it without a mask; the calls that do read a mask (the
default path, a family's position bias or indexer selection, sinks per row, padding in the middle of a local layer's
rows) get the mask transformers would have built, from the plan, here.
"""

import torch

from ..kernels.variable_length import PaddedPrompt, Segments, segment_mask
from .families.lookups import family_runs_mask_free


def planned_mask(
    attention_mask: torch.Tensor | None,
    padded_prompt: PaddedPrompt | None,
    segments: Segments | None,
    sliding_window: int | None,
    key_length: int,
    chunk: int | None = None,
) -> torch.Tensor | None:
    """The dense mask of the batch's plan, for calls that read one: the sequences of a packed batch, or a padded
    prompt's real keys with causality, within the layer's window or chunk (its layers got only the `[B, 1, 1, kv]`
    real keys, or transformers' mask)."""
    if segments is not None:
        return segment_mask(segments, sliding_window)
    if padded_prompt is not None and is_real_keys_only(attention_mask):
        return prompt_mask(padded_prompt, key_length, sliding_window, chunk)
    return attention_mask


def is_real_keys_only(attention_mask: torch.Tensor | None) -> bool:
    """Whether a planned prompt's layer got no mask or only its `[B, 1, 1, kv]` real keys, not transformers' own."""
    return attention_mask is None or attention_mask.shape[-2] == 1


def scored_mask(
    attention_mask: torch.Tensor | None,
    query: torch.Tensor,
    key: torch.Tensor,
    is_causal: bool | None,
    position_bias: torch.Tensor | None,
    selected_keys: torch.Tensor | None,
) -> torch.Tensor | None:
    """The mask with what a family adds to the scores: the keys its indexer selected per query (`indices`, top-k
    sparse attention: every other key masked, as the family does for its eager and SDPA paths) and an additive
    position bias (a float mask, the bias added). No mask with several queries is a prompt planned from an empty
    cache: causal from the first key, whatever unused slots a static cache adds after the prompt's keys."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and q_len > 1 and is_causal is not False:
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()[None, None]
    if selected_keys is not None:
        unselected = torch.ones(selected_keys.shape[0], q_len, kv_len, dtype=torch.bool, device=query.device)
        unselected = unselected.scatter(-1, selected_keys.long(), False)[:, None]
        if attention_mask is None:
            attention_mask = ~unselected
        elif attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & ~unselected
        else:
            attention_mask = attention_mask.masked_fill(unselected, torch.finfo(attention_mask.dtype).min)
    if position_bias is not None:
        if attention_mask is None:
            attention_mask = position_bias.to(query.dtype)
        elif attention_mask.dtype == torch.bool:
            blocked = torch.finfo(query.dtype).min
            attention_mask = position_bias.to(query.dtype).masked_fill(~attention_mask, blocked)
        else:
            attention_mask = attention_mask + position_bias.to(attention_mask.dtype)
    return attention_mask


def prompt_mask(
    prompt: PaddedPrompt, key_length: int, sliding_window: int | None = None, chunk: int | None = None
) -> torch.Tensor:
    """The boolean `[B, 1, q, kv]` mask transformers builds for a padded prompt: causal, over the real keys, within
    a window (positions counted as transformers counts them, padding included) or a chunk (counted from each row's
    first real token, as transformers' chunked mask does)."""
    q_len = prompt.real.shape[1]
    positions = torch.arange(key_length, device=prompt.real.device)
    query_positions, key_positions = positions[:q_len, None], positions[None, :]
    allowed = key_positions <= query_positions
    if sliding_window is not None:
        allowed = allowed & (key_positions > query_positions - sliding_window)
    real_keys = torch.nn.functional.pad(prompt.real, (0, key_length - q_len))  # a static cache's empty slots
    allowed = allowed[None] & real_keys[:, None, :]
    if chunk is not None:
        leading = (prompt.real.cumsum(dim=-1) == 0).sum(dim=-1)[:, None]  # padding before the first real token
        query_chunks = (positions[None, :q_len] - leading).div(chunk, rounding_mode="floor")
        key_chunks = (positions[None, :] - leading).div(chunk, rounding_mode="floor")
        allowed = allowed & (query_chunks[:, :, None] == key_chunks[:, None, :])
    return allowed[:, None]


def causal_padding_mask(valid_sequence_lengths: torch.Tensor, q_len: int, padding_side: str) -> torch.Tensor:
    """The boolean `[B, 1, q, q]` mask of a causal prefill whose rows hold `valid_sequence_lengths` real tokens."""
    positions = torch.arange(q_len, device=valid_sequence_lengths.device)
    if padding_side == "left":
        real = positions >= (q_len - valid_sequence_lengths)[:, None]
    else:
        real = positions < valid_sequence_lengths[:, None]
    causal = positions[None, :] <= positions[:, None]
    return (causal[None] & real[:, None, :])[:, None]


def blocked_float_rows_attend(module: torch.nn.Module, scored: bool) -> bool:
    """Whether a float mask's fully blocked row (every key at the lowest finite score) averages the values here, as
    stock's eager and SDPA attention compute it, or is zero (`dispatch.fully_masked_queries`). Where the flag plans a
    family's padded prompt, the plan's rows are zero, and the default path zeroes them too, so that the flag changes
    no output (a left-padded batch's loss reads one). Where every call reads the same mask with the flag and without
    it, the family's masks (Doge's dynamic one), a position bias or an indexer's selection (`scored`, a float mask
    built here for both paths), or a module of no served family, the row is stock's."""
    config = getattr(module, "config", None)
    return scored or config is None or not family_runs_mask_free(config.model_type)


__all__ = [
    "blocked_float_rows_attend",
    "causal_padding_mask",
    "is_real_keys_only",
    "planned_mask",
    "prompt_mask",
    "scored_mask",
]
