"""The names under which transformers finds the Gaudi attention, on any model of a qualifying family.

`attn_implementation="gaudi"` runs the Gaudi attention, with the fused kernel when a call (or the model's generation
config) sets `use_flash_attention`; `"gaudi_fused_sdpa"` runs the fused kernel unless a call turns it off. A Gaudi
class looks the attention up under "gaudi" whatever its config names (`AttentionConfigView`); a stock class that
names one of these gets the same attention, calls and masks included.

Each name comes with transformers' SDPA mask function, behind one check: the model's family must qualify
(`families/qualification.py`). transformers accepts any registered name for any model, so a family whose attention
bypasses the interface, or whose layers drop the flags, would otherwise run its own attention under a name that
promises the kernel. The check runs where transformers builds the model's masks, before any layer.
"""

import functools
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedConfig
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import FUSED_SDPA_IMPLEMENTATION, gaudi_attention_forward
from .config_view import ATTENTION_IMPLEMENTATION, AttentionConfigView
from .families.reports import family_report


def fused_attention_forward(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attn_implementation="gaudi_fused_sdpa"` on a stock class: the fused kernel, unless the call says otherwise."""
    if not isinstance(getattr(module, "config", None), AttentionConfigView):
        kwargs.setdefault("use_flash_attention", True)
    return gaudi_attention_forward(module, *args, **kwargs)


def checked_mask(*args: Any, config: PreTrainedConfig | None = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask, for a model whose family runs the Gaudi attention (a ValueError names the reason)."""
    if config is not None and not torch.compiler.is_compiling():
        refuse_unqualified_family(config.model_type, config._attn_implementation)
    return sdpa_mask(*args, config=config, **kwargs)


@functools.cache
def refuse_unqualified_family(model_type: str, name: str) -> None:
    report = family_report(model_type)
    if not report.qualifies:
        raise ValueError(
            f"attn_implementation={name!r} runs the Gaudi attention, which the model type {model_type!r} cannot use: "
            f"{report.reason}. Choose one of transformers' own attention implementations for it."
        )


def register_gaudi_attention() -> None:
    """Register the attention and its mask under our names; a name without a mask function gets no mask at all."""
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, gaudi_attention_forward)
    AttentionInterface.register(FUSED_SDPA_IMPLEMENTATION, fused_attention_forward)
    for name in (ATTENTION_IMPLEMENTATION, FUSED_SDPA_IMPLEMENTATION):
        AttentionMaskInterface.register(name, checked_mask)


register_gaudi_attention()
