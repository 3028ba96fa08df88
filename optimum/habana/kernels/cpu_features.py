"""What this CPU's instruction sets are, read from /proc/cpuinfo: the kernels' choices that depend on them (the layout
of a half-precision product's operands) and the scripts' notes (bfloat16 emulated)."""

from pathlib import Path

import torch


# x86 instructions that multiply half-precision numbers, by dtype: PyTorch's CPU products (oneDNN) use them
NATIVE_PRODUCT_CPU_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def cpu_flags() -> set[str] | None:
    """The instruction sets /proc/cpuinfo lists (x86's `flags`, Arm's `Features`); None where it cannot be read."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return flags


def cpu_native_products() -> frozenset[torch.dtype]:
    """The half-precision dtypes this x86 CPU multiplies with instructions of their own (AVX512-BF16 and AMX-BF16 for
    bfloat16, AVX512-FP16 and AMX-FP16 for float16). Elsewhere, or where /proc/cpuinfo cannot tell, none: not
    measured on Arm's BF16, so it keeps the layout measured without such instructions."""
    flags = cpu_flags() or set()
    return frozenset(dtype for dtype, names in NATIVE_PRODUCT_CPU_FLAGS.items() if flags.intersection(names))


__all__ = ["NATIVE_PRODUCT_CPU_FLAGS", "cpu_flags", "cpu_native_products"]
