"""--explain with --continuous_batching: the path of every attention call in transformers' engine steps.

The engine packs each step's requests into one row and hands every layer its paged cache. What a layer then does
depends on the flag, the device, the layer's kind and whether the decoder plans the step's sequences on the host
(`batch_layout.py`): see docs/continuous_batching.md.
"""

import torch

from optimum.habana.transformers.attention_flags import AttentionFlags
from optimum.habana.transformers.batch_layout import local_layers_run_planned
from optimum.habana.transformers.continuous_batching import steps_run_mask_free

from .layers import SINKS_VARIANT, softcap_fallback


PAGED_ENTRY = "the CPU decode kernel's paged entry (optimum.habana.kernels.cpu_decode)"
GATHERED = "the keys gathered from its pages"


def engine_call_accounts(
    flags: AttentionFlags,
    groups: list,
    config,
    device: torch.device,
    kernel: str,
    decode_kernel: bool,
    max_batch_tokens: int,
) -> list[str]:
    """The attention-call lines for engine steps with prompts and steps that decode, per layer group (`layers.py`'s
    `LayerGroup`). `kernel`: the device's fused kernel; `decode_kernel`: eager decode on CPU runs the library's."""
    engine_mask = not steps_run_mask_free(flags.use_flash_attention, config, device.type)
    # The decoder plans the step's sequences on the host where a layer may run them without the engine's mask.
    planned = (
        flags.use_flash_attention and device.type != "hpu" and (not engine_mask or local_layers_run_planned(config))
    )
    lines = [f"  engine steps with prompts (chunks of up to {max_batch_tokens} tokens, each after its cached tokens):"]
    for group in groups:
        lines.append(f"    {group.label}: {prompt_account(flags, group, kernel, engine_mask, planned)}")
    lines.append("  engine steps decoding (one query per request):")
    for group in groups:
        lines.append(f"    {group.label}: {decode_account(flags, group, kernel, engine_mask, planned, decode_kernel)}")
    return lines


def default_path(flags: AttentionFlags, group) -> str | None:
    if flags.use_flash_attention and group.softcap is None:
        return None
    why = f" ({softcap_fallback(group.softcap)})" if flags.use_flash_attention else ""
    return (
        f"default path{why}: matmul-softmax over the engine's dense [step queries, cached tokens] mask and {GATHERED}"
    )


def prompt_account(flags: AttentionFlags, group, kernel: str, engine_mask: bool, planned: bool) -> str:
    default = default_path(flags, group)
    if default is not None:
        return default
    per_sequence = (
        "once per sequence over its own keys, is_causal=True (a chunk after cached tokens: its bottom-right [q, kv] "
        "causal mask)"
    )
    if not engine_mask:
        return f"fused kernel, {kernel}: {per_sequence}, over {GATHERED}"
    masked = f"fused kernel, {kernel}: the engine's dense mask, is_causal=False, over {GATHERED}"
    if group.sliding_window is not None or not planned:
        return masked + (" (the mask keeps the window)" if group.sliding_window is not None else "")
    return f"{masked}; in a step where requests also decode, {per_sequence}"


def decode_account(
    flags: AttentionFlags, group, kernel: str, engine_mask: bool, planned: bool, decode_kernel: bool
) -> str:
    default = default_path(flags, group)
    if default is not None:
        return default
    full = group.sliding_window is None and group.chunk is None
    # Sinks (one per head) join the paged entry's softmax; other variants leave the step to the engine's gather.
    if planned and full and decode_kernel and group.variant in ("", SINKS_VARIANT):
        return (
            f"{PAGED_ENTRY}: every request's decode row in one call, reading its pages in place by the engine's read "
            "index (nothing gathered)"
        )
    if not engine_mask:
        return f"fused kernel, {kernel}: once per sequence over {GATHERED}"
    return f"fused kernel, {kernel}: the engine's dense mask, is_causal=False, over {GATHERED}"


__all__ = ["PAGED_ENTRY", "engine_call_accounts"]
