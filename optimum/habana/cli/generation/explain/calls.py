"""The path of one layer group's attention calls in one phase (the prompt's forward, the decode steps): the kernel
and its arguments, as `optimum.habana.transformers.attention` and transformers' mask skipping decide them."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from optimum.habana.kernels.dispatch import kernel_path
from optimum.habana.kernels.latent import absorbs
from optimum.habana.transformers.attention_flags import AttentionFlags

from .layers import LayerGroup, softcap_fallback


@dataclass(frozen=True)
class Phase:
    name: str  # "prefill" or "decode"
    q_len: int
    kv_lengths: tuple[int, int]  # first and last key length of the phase
    padded: bool
    from_empty_cache: bool = False  # the whole sequence each call: no cache, or the prompt's forward


def kernel_account(
    group: LayerGroup,
    phase: Phase,
    device: torch.device,
    dtype: torch.dtype,
    rows: int,
    *,
    masked: bool,
    compiled: bool,
) -> str:
    """The kernel a call of this group and phase reaches and the transforms before it, as `fused_sdpa` decides them
    (`kernel_path`), on stand-ins of the call's shapes that hold one value each (no memory, nothing runs)."""
    heads, kv_heads, head_dim, value_dim, has_sinks = group.geometry
    q_len, kv_len = phase.q_len, phase.kv_lengths[1]

    def stand_in(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.zeros(shape[-1], device=device, dtype=dtype).expand(*shape)

    mask = stand_in(rows, 1, q_len, kv_len, dtype=torch.bool) if masked else None
    path = kernel_path(
        stand_in(rows, heads, q_len, head_dim), stand_in(rows, kv_heads, kv_len, head_dim),
        stand_in(rows, kv_heads, kv_len, value_dim), mask, is_causal=mask is None and q_len > 1, dropout_p=0.0,
        sinks=torch.zeros(heads, device=device, dtype=dtype) if has_sinks else None,
    )  # fmt: skip
    if compiled and path.kernel == "split_context":  # a compiled graph's call is never cut (the thread count)
        path = path._replace(kernel="pytorch_fused", splits=1)
    return path.describe(device)


def phases(cache_kind: str, input_length: int, max_new_tokens: int, padded: bool) -> list[Phase]:
    """The prompt's forward and the decode steps, with the key lengths of a cache that holds every token (each
    layer group's own come from its cache layer: `keys.group_lengths`)."""
    result = [Phase("prefill", input_length, (input_length, input_length), padded, from_empty_cache=True)]
    if max_new_tokens > 1:
        first, last = input_length + 1, input_length + max_new_tokens - 1
        if cache_kind == "none":
            result.append(Phase("decode, whole sequence each step", first, (first, last), padded, True))
        else:
            result.append(Phase("decode", 1, (first, last), padded))
    return result


def mask_is_skipped(group: LayerGroup, phase: Phase) -> bool:
    """transformers passes no mask when causality alone is exact (masking_utils._ignore_causal_mask_sdpa)."""
    if phase.padded:
        return False
    if group.sliding_window is not None and phase.kv_lengths[1] >= group.sliding_window:
        return False
    if phase.name != "prefill" and phase.from_empty_cache:
        return True  # each step reads the whole sequence: as many keys as queries
    return phase.q_len == 1 or phase.kv_lengths == (phase.q_len, phase.q_len)


def absorbed_phase(group: LayerGroup, q_len: int) -> bool:
    """Whether a latent attention layer's call of `q_len` query rows absorbs its up-projection (`kernels.latent`)."""
    (latent_size, rope), (_, _, head_dim, value_dim, _) = group.latent, group.geometry
    return absorbs(q_len, latent_size, rope, head_dim - rope, value_dim)


def call_account(
    flags: AttentionFlags,
    group: LayerGroup,
    phase: Phase,
    device: torch.device,
    model_mask_free: bool,
    kernel: Callable[..., str],
    masks_from_config: bool = True,
    causal_mask_plans: bool = True,
) -> str:
    """The path of this group's calls in this phase, and the arguments the kernel gets (`kernel`: `kernel_account`
    with the run's device, dtype and rows, which names the kernel and the transforms before it). `masks_from_config`:
    generate() builds a static cache's masks as the family does (`generation_masks_are_the_familys`), so it may hand
    the decoder the prompt's 2-D mask to plan instead. `causal_mask_plans`: the causal-mask mode plans a padded prompt
    (not where the family's attention makes its own mask: `attention_with_its_own_mask`)."""
    is_prefill = phase.q_len > 1
    mask_skipped = mask_is_skipped(group, phase)
    mask = "None" if mask_skipped else f"boolean [rows, 1, {phase.q_len}, kv]"
    if not flags.use_flash_attention or group.softcap is not None:
        softmax = "model dtype" if flags.attn_softmax_bf16 else "float32"
        why = ""
        if flags.use_flash_attention:
            why = f" ({softcap_fallback(group.softcap)}; one warning)"
        causal = ", causal" if mask_skipped and is_prefill else ""
        return f"default path{why}: matmul-softmax, softmax in {softmax}, mask {mask}{causal}, scale {group.scaling:g}"
    # The decoder plans a padded prompt from an empty cache once (batch_layout) where its 2-D mask reaches it (a
    # dynamic cache or none; a static one where generate() builds the family's masks, as it then hands the 2-D mask
    # on): without a mask where no layer needs more than the padding and the device's kernel does not read the mask;
    # in the causal-mask mode whatever the layers.
    no_cache_step = phase.name != "prefill"  # without a KV cache every step is a prefill from empty
    dynamic_prefill = no_cache_step or phase.kv_lengths == (phase.q_len, phase.q_len)
    two_d_mask = is_prefill and phase.from_empty_cache and (dynamic_prefill or masks_from_config)
    mask_free = (
        phase.padded
        and two_d_mask
        and model_mask_free
        and not (device.type == "hpu" and not flags.flash_attention_causal_mask)
    )
    planned = mask_free or (two_d_mask and flags.flash_attention_causal_mask and causal_mask_plans)
    window = group.sliding_window if group.sliding_window is not None and phase.q_len > group.sliding_window else None
    chunk = group.chunk if group.chunk is not None and phase.q_len > group.chunk else None
    # Off Gaudi a planned prompt's local layer runs in windows or chunks (kernels/local_attention.py); on Gaudi, and
    # where the plan kept transformers' mask, the mask keeps the window.
    runs_local = (
        (window or chunk) and is_prefill and phase.from_empty_cache and model_mask_free and device.type != "hpu"
    )
    window_kept = planned and window is not None and not runs_local
    if window_kept:
        planned = False
    prompt_companions = is_prefill and (flags.flash_attention_recompute or flags.flash_attention_fast_softmax)
    if (
        group.latent is not None
        and not (planned or window or prompt_companions)
        and absorbed_phase(group, phase.q_len)
    ):
        return (
            f"over the compressed cache (kv_b_proj absorbed into the query and the output; kernels/latent.py): "
            f"attn_mask={mask}, is_causal={mask_skipped and is_prefill}, scale={group.scaling:g}"
        )
    masked = False  # whether the kernel reads a mask: the last case below, where the phase keeps one
    if runs_local and window:
        arguments = (
            f"attn_mask=None within a window of {window}: the first {window} queries causally, then blocks of "
            f"{window} queries over their own and the previous block (one [{window}, {2 * window}] band mask)"
        )
    elif runs_local:
        arguments = f"attn_mask=None, is_causal=True within each chunk of {chunk} (the chunks stacked in one call)"
    elif planned and device.type == "hpu" and phase.padded:
        arguments = "attn_mask=None, is_causal=True, valid lengths per row"
    elif planned and phase.padded:
        arguments = (
            "attn_mask=None, is_causal=True over each row's real tokens (rows permuted so that they come first)"
        )
    elif planned or (mask_skipped and is_prefill):
        arguments = "attn_mask=None, is_causal=True"
    else:
        arguments = f"attn_mask={mask}" + (" (additive)" if device.type == "hpu" else "") + ", is_causal=False"
        masked = not mask_skipped
    if mask_free or runs_local:
        arguments += " (no padding mask is built)" if not runs_local else " (no [q, kv] mask is built)"
    softmax_mode = "fast" if flags.flash_attention_fast_softmax and is_prefill else "None"
    recompute = flags.flash_attention_recompute and is_prefill
    account = (
        f"fused kernel, {kernel(group, phase, masked=masked)}: {arguments}, scale={group.scaling:g}, "
        f"softmax_mode={softmax_mode}, "
        f"recompute={recompute}"
    )
    if window_kept:
        account += f" (sliding window {group.sliding_window} < prompt: the mask keeps it; one warning)"
    if softmax_mode == "fast" and device.type != "hpu":
        account += " (no fast softmax here: one warning, exact softmax)"
    return account


def format_range(bounds: tuple[int, int]) -> str:
    return str(bounds[0]) if bounds[0] == bounds[1] else f"{bounds[0]}..{bounds[1]}"


__all__ = ["Phase", "call_account", "format_range", "kernel_account", "phases"]
