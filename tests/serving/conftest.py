"""The serving tests' shared checkpoint: a tiny Llama whose generations end only when something stops them."""

import pytest

from tests.serving.servers import save_long_context_checkpoint


@pytest.fixture(scope="session")
def long_checkpoint(tmp_path_factory):
    return save_long_context_checkpoint(tmp_path_factory.mktemp("tiny_llama_long_context"))
