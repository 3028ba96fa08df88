"""Context parallelism beyond one family per variant (`tests/core/test_context_parallel.py`): the families whose
variants combine (sinks with latent attention, soft-capping) and more of each, over two gloo processes."""

import pytest

from tests.core.test_context_parallel import assert_trained_as_one_process, run_worker


pytestmark = pytest.mark.families

CASES = [
    "mimo_v2_flash:padded:on",  # sinks, latent attention and alternating windows together
    "gemma2:padded:on",  # soft-capped logits: the default path on every process, with a warning
    "granite_swa:packed:on",  # sinks beside windows, packed
    "deepseek_v2:packed:on",  # latent attention, packed
    "cohere2:padded:off",
    "dots1:padded:on",
]


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict:
    return run_worker(tmp_path_factory.mktemp("context_parallel") / "records.json", CASES)


@pytest.mark.parametrize("case", CASES)
def test_two_processes_train_a_step_of_the_family_as_one_does(records, case):
    assert_trained_as_one_process(records[case])
