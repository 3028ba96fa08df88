"""The five attention flags, their validation and their precedence, shared by every route that sets them.

A flag can be given per call (forward or generate kwarg), per generate call through a generation config, or per
model through `model.generation_config`. Each is resolved on its own: the first route that sets it wins, and
unset means off.
"""

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any


# Flags that only mean something with the fused kernel, and the one that only means something without it.
FLASH_ATTENTION_COMPANIONS = (
    "flash_attention_recompute",
    "flash_attention_causal_mask",
    "flash_attention_fast_softmax",
)
DEFAULT_PATH_FLAGS = ("attn_softmax_bf16",)


@dataclass(frozen=True)
class AttentionFlags:
    """Which attention runs and how; see docs/attention.md for what each flag does per device."""

    use_flash_attention: bool = False
    flash_attention_recompute: bool = False
    flash_attention_causal_mask: bool = False
    flash_attention_fast_softmax: bool = False
    attn_softmax_bf16: bool = False

    def __post_init__(self) -> None:
        for name, value in self.as_dict().items():
            check_flag_value(name, value)
        check_flag_combination(self.as_dict())

    def as_dict(self) -> dict[str, bool]:
        return asdict(self)


ATTENTION_FLAG_NAMES = tuple(field.name for field in fields(AttentionFlags))


def check_flag_value(name: str, value: Any) -> None:
    """Flags are booleans; None means "not set here"."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}.")


def check_flag_combination(flags: Mapping[str, Any]) -> None:
    """Reject settings that would silently do nothing."""
    use_flash_attention = flags.get("use_flash_attention")
    for name in FLASH_ATTENTION_COMPANIONS:
        if flags.get(name) and not use_flash_attention:
            raise ValueError(
                f"`{name}` requires `use_flash_attention`: it configures the fused attention kernel. "
                f"Turn `use_flash_attention` on, or drop `{name}`."
            )
    for name in DEFAULT_PATH_FLAGS:
        if flags.get(name) and use_flash_attention:
            raise ValueError(
                f"`{name}` applies to the default (matmul-softmax) attention and has no effect with "
                f"`use_flash_attention`, whose kernel computes the softmax itself. Drop one of the two "
                "(`flash_attention_fast_softmax` is the fused kernel's faster softmax)."
            )


def attention_flags_of(config: Any) -> dict[str, bool | None]:
    """The flags a generation config (ours, or a plain one carrying them as custom entries) sets."""
    if config is None:
        return {}
    return {name: getattr(config, name) for name in ATTENTION_FLAG_NAMES if getattr(config, name, None) is not None}


def resolve_attention_flags(*routes: Mapping[str, bool | None]) -> AttentionFlags:
    """Resolve each flag from `routes`, highest priority first; None or absent means "not set by that route".

    A flag set on a lower-priority route than the `use_flash_attention` value that disables it is dropped: a model
    configured for flash attention with recompute, called with `use_flash_attention=False`, runs the default path.
    The same conflict on one route, or a higher-priority one, is an error.
    """
    values: dict[str, bool] = {}
    priority: dict[str, int] = {}
    for name in ATTENTION_FLAG_NAMES:
        values[name], priority[name] = False, len(routes)
        for rank, route in enumerate(routes):
            value = route.get(name)
            check_flag_value(name, value)
            if value is not None:
                values[name], priority[name] = value, rank
                break
    main = priority["use_flash_attention"]
    inactive = DEFAULT_PATH_FLAGS if values["use_flash_attention"] else FLASH_ATTENTION_COMPANIONS
    for name in inactive:
        if values[name] and priority[name] > main:
            values[name] = False
    return AttentionFlags(**values)
