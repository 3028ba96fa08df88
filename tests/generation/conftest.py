"""Fixtures of the run_generation.py tests: the script as a module, a tiny checkpoint, the embedded model, and a
cache folder of the module's own (never the user's cache, never the hub)."""

from pathlib import Path

import pytest

from optimum.habana.utils.model_loading import CACHE_ENV_VAR
from tests.helpers import embedded_model, load_script, save_tiny_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every run_generation.py test, on one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("optimum_habana_cache")


@pytest.fixture(autouse=True)
def _use_module_cache(monkeypatch, cache_dir):
    """Keep every test away from the user's cache, and from the hub."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(cache_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def script():
    """run_generation.py as a module, for calling main(argv) in this process."""
    return load_script("examples/text-generation/run_generation.py")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    """The embedded SmolLM2's cache folder and resolution, converted once per session (tests/helpers.py)."""
    return embedded_model(tmp_path_factory)
