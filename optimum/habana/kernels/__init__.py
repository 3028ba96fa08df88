"""Fused attention kernels: `dispatch` picks one by device; the Gaudi calls themselves live in `optimum.habana.hpu`."""

from .dispatch import FusedSDPAUnavailable, fused_sdpa


__all__ = ["FusedSDPAUnavailable", "fused_sdpa"]
