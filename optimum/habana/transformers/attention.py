"""The Gaudi attention: one function that transformers' attention interface calls for every layer.

With `use_flash_attention` it runs the fused kernel of the device (`optimum.habana.kernels`); otherwise, or when
no fused kernel can take the inputs, the explicit matmul-softmax attention. It is registered under the name
"gaudi" together with transformers' SDPA mask function, so any model family that looks its attention up through
`ALL_ATTENTION_FUNCTIONS` (Llama, Mistral, Qwen2, ...) can use it by setting `attn_implementation="gaudi"`.

The mask contract (from `transformers.masking_utils.sdpa_mask`): a boolean `[B, 1, q, kv]` mask (True = attend),
or None when causality alone is exact: "causal, top-left aligned" for q > 1, "no mask" for q == 1.
"""

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..kernels.dispatch import FusedSDPAUnavailable, fused_sdpa, warn_once
from .attention_flags import ATTENTION_FLAG_NAMES, AttentionFlags


ATTENTION_IMPLEMENTATION = "gaudi"


def gaudi_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    valid_sequence_lengths: torch.Tensor | None = None,
    padding_side: str = "left",
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention for query `[B, H, q, D]` and key/value `[B, Hkv, kv, D]`; returns `([B, q, H, D], weights)`.

    The flags arrive as keyword arguments from the model's forward. `valid_sequence_lengths` (int32 `[B]`) marks
    a prefill from an empty cache whose batch is padded on `padding_side`; with `flash_attention_causal_mask` the
    fused kernel then runs causally over the real tokens instead of reading a mask.
    Weights are returned by the default path only: the fused kernel never materialises them.
    """
    flags = AttentionFlags(**{name: bool(kwargs.get(name)) for name in ATTENTION_FLAG_NAMES})
    if flags.use_flash_attention:
        try:
            output = flash_attention(
                module,
                query,
                key,
                value,
                attention_mask,
                scaling,
                dropout,
                flags,
                valid_sequence_lengths,
                padding_side,
            )
            return output.transpose(1, 2).contiguous(), None
        except FusedSDPAUnavailable as reason:
            warn_once(f"use_flash_attention: {reason}. Running the default attention instead; results are unchanged.")
    softmax_dtype = query.dtype if flags.attn_softmax_bf16 else torch.float32
    return matmul_softmax_attention(
        query, key, value, attention_mask, scaling, dropout if module.training else 0.0, softmax_dtype
    )


def flash_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    flags: AttentionFlags,
    valid_sequence_lengths: torch.Tensor | None,
    padding_side: str,
) -> torch.Tensor:
    """Choose the kernel arguments for this phase; returns `[B, H, q, D]`."""
    q_len = query.shape[2]
    is_prefill = q_len > 1
    if not (flags.flash_attention_causal_mask and is_prefill):
        valid_sequence_lengths = None
    if valid_sequence_lengths is not None or (attention_mask is None and is_prefill):
        # Causal prefill from an empty cache: a static cache's unused slots lie past the prompt, drop them.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        attention_mask, is_causal = None, True
    else:
        is_causal = False
    return fused_sdpa(
        query,
        key,
        value,
        attention_mask,
        is_causal=is_causal,
        scale=scaling,
        dropout_p=dropout if module.training else 0.0,
        # The fast softmax pays off on long prompts only; decode stays exact (it cost throughput there).
        softmax_mode="fast" if flags.flash_attention_fast_softmax and is_prefill else "None",
        # Recomputation trades compute for memory where there is memory to save: prefill and training.
        recompute=flags.flash_attention_recompute and (is_prefill or module.training),
        valid_sequence_lengths=valid_sequence_lengths,
        padding_side=padding_side,
    )


def matmul_softmax_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float = 0.0,
    softmax_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The default path: `softmax(Q Kᵀ * scale + mask) V`, with the full score matrix.

    Grouped-query attention views the query as `[B, Hkv, groups, q, D]` so key/value are never repeated.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    scaling = head_dim**-0.5 if scaling is None else scaling
    grouped_query = query.view(batch, kv_heads, heads // kv_heads, q_len, head_dim)

    scores = torch.matmul(grouped_query, key.unsqueeze(2).transpose(-1, -2)) * scaling
    if attention_mask is None and q_len > 1:
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
    if attention_mask is not None:
        if attention_mask.dim() == 4:
            attention_mask = attention_mask.unsqueeze(2)  # [B, 1 or H, q, kv] -> broadcast over the groups
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask

    probabilities = nn.functional.softmax(scores, dim=-1, dtype=softmax_dtype).to(query.dtype)
    probabilities = nn.functional.dropout(probabilities, p=dropout, training=dropout > 0.0)
    output = torch.matmul(probabilities, value.unsqueeze(2))
    output = output.view(batch, heads, q_len, -1).transpose(1, 2).contiguous()
    return output, probabilities.view(batch, heads, q_len, kv_len)


def register_gaudi_attention() -> None:
    """Register the attention and its mask under one name; a name without a mask function gets no mask at all."""
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, gaudi_attention_forward)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)


register_gaudi_attention()
