"""One torch thread per pytest-xdist worker: workers that each use every core slow each other down many times.

`one_torch_thread` makes it one for a module's tests also without xdist: the example scripts' runs there start
processes of their own, which must not compete with two threads of this one on a 2-core machine.
"""

import gc
import os

import pytest
import torch


if os.environ.get("PYTEST_XDIST_WORKER"):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture
def threads():
    """Set the torch thread count for one test (the suite runs one per worker)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection built (thousands of test items, transformers' test modules) out of the garbage
    collector's view: transformers' continuous-batching manager runs a full `gc.collect()` twice per stop (and
    accelerate one whenever a Trainer frees memory), and the collector's time grows with every object alive in the
    process, not with what the test made."""
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a test module's last test and its fixtures, the same for what the module left alive (the modules it
    imported, compiled graphs, caches): collected first, so that its garbage is freed, then frozen."""
    yield
    if nextitem is None or nextitem.module is not item.module:
        gc.collect()
        gc.freeze()
