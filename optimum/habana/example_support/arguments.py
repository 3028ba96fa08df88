"""Command-line arguments shared by the example scripts, as dataclasses for `HfArgumentParser`."""

import math
from dataclasses import field, fields, is_dataclass, make_dataclass

from ..transformers.attention_flags import AttentionFlags


def _attention_flags(self) -> AttentionFlags:
    """The validated flags; a ValueError names the offending combination."""
    return AttentionFlags(**{flag.name: getattr(self, flag.name) for flag in fields(AttentionFlags)})


# One command-line switch per attention flag (`--use_flash_attention`, or `--use_flash_attention True`), with the
# flag's own default and help text: adding a flag to AttentionFlags adds it here.
AttentionArguments = make_dataclass(
    "AttentionArguments",
    [
        (flag.name, flag.type, field(default=flag.default, metadata={"help": flag.metadata["help"]}))
        for flag in fields(AttentionFlags)
    ],
    namespace={"_argument_group_name": "flash attention", "attention_flags": _attention_flags},
)
AttentionArguments.__module__ = __name__
AttentionArguments.__doc__ = "The attention flags, one command-line switch each."


# numpy's global generator, which transformers' set_seed seeds too, takes seeds in [0, 2**32).
SEED_RANGE = range(2**32)


def check_finite_numbers(*arguments: object) -> None:
    """Refuse nan and inf in any float argument of the given dataclasses or argparse namespaces.

    Python's float() parses "nan" and "inf", so argparse and HfArgumentParser let them through; a nan learning rate
    or LoRA alpha then trains a nan model without a word. Call it right after parsing, before anything is loaded.
    Raises ValueError naming the flag (`--field_name`) and the value.
    """
    for argument in arguments:
        for name, value in _argument_values(argument):
            values = value if isinstance(value, (list, tuple)) else [value]
            for item in values:
                if isinstance(item, float) and not math.isfinite(item):
                    raise ValueError(f"--{name} must be a finite number, got {item}.")


def check_seed(value: int | None, flag: str = "--seed") -> None:
    """Refuse a seed outside [0, 2**32), which numpy rejects with a traceback only once training starts."""
    if value is not None and value not in SEED_RANGE:
        raise ValueError(f"{flag} must be in [0, {SEED_RANGE.stop - 1}], got {value}.")


def _argument_values(argument: object) -> list[tuple[str, object]]:
    """(name, value) of a dataclass's init fields or of a namespace's attributes."""
    if is_dataclass(argument) and not isinstance(argument, type):
        return [(item.name, getattr(argument, item.name)) for item in fields(argument) if item.init]
    return list(vars(argument).items())
