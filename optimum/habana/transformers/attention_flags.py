"""The attention flags: defined once here, with their validation and their precedence.

Everything else derives from `AttentionFlags`: the generation config's attributes, the keyword arguments the models'
`forward` takes, the command-line arguments of the example scripts and the attention function's reading of them.
Each field says what it means (`help`) and which path it configures (`applies_to`): "fused" flags need
`use_flash_attention`, "default" flags configure the default path: with `use_flash_attention` they apply to the calls
that take it anyway (soft-capped logits, attention weights asked for), and the attention says so once. Adding a flag means adding a field here and the code
that acts on it.

A flag can be given per call (forward or generate kwarg), per generate call through a generation config, or per
model through `model.generation_config`. Each is resolved on its own: the first route that sets it wins, and
unset means off.
"""

import difflib
import functools
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, TypedDict

import torch


AppliesTo = Literal["switch", "fused", "default"]


def _flag(help: str, applies_to: AppliesTo) -> Any:
    return field(default=False, metadata={"help": help, "applies_to": applies_to})


@dataclass(frozen=True)
class AttentionFlags:
    """Which attention runs and how; docs/attention.md says what each flag does per device."""

    use_flash_attention: bool = _flag(
        "Run attention through the fused kernel (Gaudi FusedSDPA; PyTorch's fused SDPA on CUDA/CPU) instead of the "
        "default matmul-softmax attention. Same results, O(N) instead of O(N^2) attention memory.",
        "switch",
    )
    flash_attention_recompute: bool = _flag(
        "With use_flash_attention: recompute attention in backward and on the prompt instead of keeping "
        "intermediates (Gaudi). PyTorch's fused kernels always recompute.",
        "fused",
    )
    flash_attention_causal_mask: bool = _flag(
        "With use_flash_attention: run a padded prompt through the kernel's causal mode with per-row valid lengths "
        "instead of a materialised padding mask.",
        "fused",
    )
    flash_attention_fast_softmax: bool = _flag(
        "With use_flash_attention: the kernel's faster, slightly less exact softmax, on the prompt only (Gaudi; "
        "elsewhere a warning and the exact softmax).",
        "fused",
    )
    attn_softmax_bf16: bool = _flag(
        "Default attention: softmax in the model dtype (bf16) instead of fp32. With use_flash_attention it applies "
        "only to the calls that take the default path; the fused kernel computes its own softmax.",
        "default",
    )

    def __post_init__(self) -> None:
        for name, value in self.as_dict().items():
            check_flag_value(name, value)
        check_flag_combination(self.as_dict())

    def as_dict(self) -> dict[str, bool]:
        return asdict(self)


ATTENTION_FLAG_NAMES = tuple(flag.name for flag in fields(AttentionFlags))
ATTENTION_FLAG_HELP = {flag.name: flag.metadata["help"] for flag in fields(AttentionFlags)}
# Flags that only mean something with the fused kernel, and those that only mean something without it.
FLASH_ATTENTION_COMPANIONS = tuple(
    flag.name for flag in fields(AttentionFlags) if flag.metadata["applies_to"] == "fused"
)
DEFAULT_PATH_FLAGS = tuple(flag.name for flag in fields(AttentionFlags) if flag.metadata["applies_to"] == "default")

# The flags as keyword arguments of a model's forward and generate (None: not set by this call).
AttentionFlagKwargs = TypedDict("AttentionFlagKwargs", dict.fromkeys(ATTENTION_FLAG_NAMES, bool | None), total=False)


def check_flag_value(name: str, value: Any) -> None:
    """Flags are booleans; None means "not set here"."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}.")


def check_flag_combination(flags: Mapping[str, Any]) -> None:
    """Reject settings that would silently do nothing.

    Default-path flags with `use_flash_attention` are accepted: some calls take the default path whatever the flag
    (soft-capping, attention weights), and Optimum-Habana's command lines combine the two.
    """
    use_flash_attention = flags.get("use_flash_attention")
    for name in FLASH_ATTENTION_COMPANIONS:
        if flags.get(name) and not use_flash_attention:
            raise ValueError(
                f"`{name}` requires `use_flash_attention`: it configures the fused attention kernel. "
                f"Turn `use_flash_attention` on, or drop `{name}`."
            )


def attention_flags_of(config: Any) -> dict[str, bool | None]:
    """The flags a generation config (ours, or a plain one carrying them as custom entries) sets."""
    if config is None:
        return {}
    return {name: getattr(config, name) for name in ATTENTION_FLAG_NAMES if getattr(config, name, None) is not None}


def pop_attention_flags(kwargs: dict[str, Any]) -> dict[str, bool | None]:
    """Remove the flags from a call's keyword arguments and return those it sets."""
    return {name: kwargs.pop(name) for name in ATTENTION_FLAG_NAMES if name in kwargs}


def check_flag_spelling(names: Iterable[str]) -> None:
    """A keyword a few letters away from a flag (`use_flash_attentoin`) is a TypeError naming it and the flag: passed
    on, it would reach the attention as an argument nothing reads (and the flag would be silently off)."""
    for name in names:
        if name not in ATTENTION_FLAG_NAMES and (flag := closest_flag(name)) is not None:
            raise TypeError(f"`{name}` is not a keyword argument of optimum.habana's models: did you mean `{flag}`?")


@functools.cache
def closest_flag(name: str) -> str | None:
    return next(iter(difflib.get_close_matches(name, ATTENTION_FLAG_NAMES, n=1, cutoff=0.8)), None)


def call_attention_flags(kwargs: dict[str, Any], defaults: Mapping[str, bool | None] | None = None) -> AttentionFlags:
    """Remove the flags from one attention call's keyword arguments and resolve them over the model's `defaults`.

    A Gaudi model's forward passes all five; a call that enters below it (the decoder, a layer, the attention
    module itself) passes none, and the model's defaults decide. The attention runs this for every layer and
    decode step: each combination of values is validated once.
    """
    values = tuple(kwargs.pop(name, None) for name in ATTENTION_FLAG_NAMES)
    fallback = tuple((defaults or {}).get(name) for name in ATTENTION_FLAG_NAMES)
    booleans = all(value is None or value is True or value is False for value in values + fallback)
    if booleans and not torch.compiler.is_compiling():
        return _two_route_flags(values, fallback)
    return resolve_attention_flags(  # traced as constants when compiling; raises the ValueError naming a bad value
        dict(zip(ATTENTION_FLAG_NAMES, values, strict=True)), dict(zip(ATTENTION_FLAG_NAMES, fallback, strict=True))
    )


@functools.cache
def _two_route_flags(values: tuple[bool | None, ...], fallback: tuple[bool | None, ...]) -> AttentionFlags:
    return resolve_attention_flags(
        dict(zip(ATTENTION_FLAG_NAMES, values, strict=True)), dict(zip(ATTENTION_FLAG_NAMES, fallback, strict=True))
    )


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
