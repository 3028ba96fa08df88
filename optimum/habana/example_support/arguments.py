"""Command-line arguments shared by the example scripts, as dataclasses for `HfArgumentParser`."""

from dataclasses import field, fields, make_dataclass

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
