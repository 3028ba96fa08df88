"""run_lora_clm.py --explain: how each training sequence is laid out over the processes and which attention each
process runs, per group of layers, read from the model built on the meta device (no weights, nothing trained)."""

import torch
from transformers import PreTrainedConfig

from optimum.habana.cli.generation.explain import (
    Phase,
    attention_layer_groups,
    gaudi_class_of,
    kernel_account,
    meta_model,
)
from optimum.habana.transformers.context_parallel import key_value_replication


def explain_training(
    config: PreTrainedConfig,
    *,
    context_parallel_size: int,
    world_size: int,
    max_seq_length: int,
    use_flash_attention: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> str:
    """The lines --explain prints; `config` is the checked model's (a family that cannot be split was refused)."""
    size = context_parallel_size
    model = meta_model(gaudi_class_of(config.model_type, f"The model ({config.model_type})"), config)
    groups = attention_layer_groups(model)
    padded = -(-max_seq_length // size) * size
    lines = [f"Processes: {world_size}; context parallel size {size}; {world_size // size} data-parallel replica(s)."]
    if size == 1:
        lines.append(f"Sequences: whole on each process (up to {max_seq_length} tokens).")
    else:
        lines.append(
            f"Sequences: up to {max_seq_length} tokens, padded to a multiple of {size} ({padded}); each process holds "
            f"{padded // size} consecutive positions of each sequence for the embeddings, norms, MLPs, LM head and "
            "loss (the labels shifted before the cut), and inside each attention call the whole sequence for its "
            "share of the heads (an all-to-all before and after the call)."
        )
    for group in groups:
        heads, key_value_heads, head_dim, value_dim, _ = group.geometry
        if size > 1:
            factor = key_value_replication(heads, key_value_heads, size)
            repeat = f", each key/value head repeated x{factor}" if factor > 1 else ""
            share = f"{heads // size} of {heads} query heads and {key_value_heads * factor // size} of {key_value_heads} key/value heads{repeat}"
        else:
            share = f"{heads} query heads and {key_value_heads} key/value heads"
        phase = Phase("training", padded, (padded, padded), padded=True, from_empty_cache=True)
        attention = (
            kernel_account(group, phase, device, dtype, 1, masked=False, compiled=False)
            if use_flash_attention
            else "the default matmul-softmax attention (use_flash_attention off)"
        )
        lines.append(
            f"{group.label}: per process {share} (heads of {head_dim}"
            + (f", values of {value_dim}" if value_dim != head_dim else "")
            + f") over {padded} positions; attention: {attention}."
        )
    return "\n".join(lines)


__all__ = ["explain_training"]
