"""One torch thread per pytest-xdist worker: workers that each use every core slow each other down many times."""

import os

import torch


if os.environ.get("PYTEST_XDIST_WORKER"):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
