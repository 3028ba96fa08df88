"""Device choice, default dtype, synchronisation and memory readings for the example scripts and benchmarks.

HPU calls go through `optimum.habana.hpu`; CUDA through torch.cuda; the CPU reads the process's resident memory.
"""

import contextlib
import os
import resource
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from .. import hpu
from ..kernels.cpu_features import cpu_flags


DEVICE_CHOICES = ("auto", "cpu", "cuda", "hpu")


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` picks HPU, then CUDA, then CPU; an explicit device that is not present is an error."""
    if name not in DEVICE_CHOICES:
        raise ValueError(f"--device {name!r} is not one of {', '.join(DEVICE_CHOICES)}.")
    if name == "auto":
        if hpu.is_hpu_available():
            return torch.device("hpu")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "hpu" and not hpu.is_hpu_available():
        raise ValueError("--device hpu: no Gaudi device found (habana_frameworks missing or no card visible).")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device found (torch.cuda.is_available() is False).")
    return torch.device(name)


# /proc/cpuinfo flags of CPUs with bfloat16 arithmetic: x86 (AVX512-BF16, AMX) and Arm (FEAT_BF16).
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU computes in bfloat16 natively; None where /proc/cpuinfo cannot tell (not Linux)."""
    flags = cpu_flags()
    return None if flags is None else any(flag in flags for flag in NATIVE_BF16_CPU_FLAGS)


def slow_bf16_note(device: torch.device, dtype: torch.dtype) -> str | None:
    """One line for bf16 on a CPU that only emulates it, or None: PyTorch then runs it many times slower than fp32."""
    if device.type != "cpu" or dtype != torch.bfloat16 or cpu_has_native_bf16() is not False:
        return None
    return (
        "bfloat16 on this CPU is emulated (no AVX512-BF16, AMX or Arm BF16 instructions): expect it to run many "
        "times slower than float32 (10x for a SmolLM2 training step on such a machine). Use float32 here for speed."
    )


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the hardware is built for it (HPU, CUDA), fp32 on CPU."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "hpu":
        hpu.synchronize_hpu()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (on CPU: the kernel's peak-RSS counter, where Linux allows it)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "hpu":
        hpu.reset_hpu_peak_memory()
    else:
        clear_refs = Path("/proc/self/clear_refs")
        if clear_refs.exists():
            with contextlib.suppress(OSError):
                clear_refs.write_text("5")


def memory_stats(device: torch.device) -> dict[str, int]:
    """Bytes: `allocated` now and `max_allocated` since the last reset (CPU: resident set and its peak)."""
    if device.type == "cuda":
        return {
            "allocated": torch.cuda.memory_allocated(device),
            "max_allocated": torch.cuda.max_memory_allocated(device),
        }
    if device.type == "hpu":
        return hpu.hpu_memory_stats()
    return {"allocated": _current_rss(), "max_allocated": _peak_rss()}


def total_memory(device: torch.device) -> int | None:
    """Bytes the device has in all (CPU: the machine's physical memory); None where it does not say."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "hpu":
        return hpu.hpu_memory_stats().get("total")
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _current_rss() -> int:
    return _proc_status_bytes("VmRSS") or _peak_rss()


def _peak_rss() -> int:
    return _proc_status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _proc_status_bytes(field: str) -> int | None:
    """A memory line of /proc/self/status (Linux), in bytes; None elsewhere."""
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return None


def model_size_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers held by this process, counted once each (tied weights share storage).

    A tensor-parallel model's parameters are DTensors: only the local shard counts, so each rank reports its part.
    """
    local = [_local_tensor(t) for t in [*model.parameters(), *model.buffers()]]
    tensors = {t.data_ptr(): t for t in local}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
