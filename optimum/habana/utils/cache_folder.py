"""Where the library keeps what it works out once: converted checkpoints, built kernels, the families' table.

One folder, per user by default (platformdirs' cache folder), moved with the ``OPTIMUM_HABANA_CACHE`` environment
variable; each user of it makes and names its own subfolder.
"""

import os
from pathlib import Path

import platformdirs


CACHE_ENV_VAR = "OPTIMUM_HABANA_CACHE"


def cache_root() -> Path:
    """The cache folder; the ``OPTIMUM_HABANA_CACHE`` environment variable overrides it."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("optimum-gaudi-flash"))


__all__ = ["CACHE_ENV_VAR", "cache_root"]
