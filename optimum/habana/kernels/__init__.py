"""Fused attention kernels: the one place that knows devices."""

from .fused_sdpa import FusedSDPAUnavailable, fused_sdpa


__all__ = ["FusedSDPAUnavailable", "fused_sdpa"]
