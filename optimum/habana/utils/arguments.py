"""Command-line arguments shared by the example scripts, as dataclasses for `HfArgumentParser`."""

from dataclasses import dataclass, field

from ..transformers.attention_flags import AttentionFlags


@dataclass
class AttentionArguments:
    """The attention flags, one command-line switch each (`--use_flash_attention`, or `--use_flash_attention True`)."""

    _argument_group_name = "flash attention"  # the heading of these flags in --help

    use_flash_attention: bool = field(
        default=False,
        metadata={
            "help": "Run attention through the fused kernel (Gaudi FusedSDPA; PyTorch's fused SDPA on CUDA/CPU) "
            "instead of the default matmul-softmax attention. Same results, O(N) instead of O(N^2) attention memory."
        },
    )
    flash_attention_recompute: bool = field(
        default=False,
        metadata={
            "help": "With --use_flash_attention: recompute attention in backward and on the prompt instead of keeping "
            "intermediates (Gaudi). PyTorch's fused kernels always recompute."
        },
    )
    flash_attention_causal_mask: bool = field(
        default=False,
        metadata={
            "help": "With --use_flash_attention: run the prompt through the kernel's causal mode with per-row valid "
            "lengths instead of a materialised padding mask."
        },
    )
    flash_attention_fast_softmax: bool = field(
        default=False,
        metadata={
            "help": "With --use_flash_attention: the kernel's faster, slightly less exact softmax, on the prompt only "
            "(Gaudi; elsewhere a warning and the exact softmax)."
        },
    )
    attn_softmax_bf16: bool = field(
        default=False,
        metadata={
            "help": "Default attention only (not with --use_flash_attention): softmax in the model dtype (bf16) "
            "instead of fp32."
        },
    )

    def attention_flags(self) -> AttentionFlags:
        """The validated flags; a ValueError names the offending combination."""
        return AttentionFlags(
            use_flash_attention=self.use_flash_attention,
            flash_attention_recompute=self.flash_attention_recompute,
            flash_attention_causal_mask=self.flash_attention_causal_mask,
            flash_attention_fast_softmax=self.flash_attention_fast_softmax,
            attn_softmax_bf16=self.attn_softmax_bf16,
        )
