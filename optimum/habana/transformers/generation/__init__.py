"""Generation with the attention flags."""

from .configuration_utils import GaudiGenerationConfig
from .utils import GaudiGenerationMixin


__all__ = ["GaudiGenerationConfig", "GaudiGenerationMixin"]
