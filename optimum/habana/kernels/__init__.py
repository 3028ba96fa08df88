"""Fused attention kernels: the one place that knows devices."""

from .dispatch import FusedSDPAUnavailable, fused_sdpa


__all__ = ["FusedSDPAUnavailable", "fused_sdpa"]
