"""One measurement per fresh process, so that its peak memory belongs to it alone: both ends of that protocol.

The parent script calls `run_worker` once per path and row; the worker module (`python -m <worker> '<json task>'`)
measures and ends with `report_measurement`, whose last stdout line is `RESULT_MARKER` followed by the JSON result.
A run that runs out of memory reports `"status": "oom"`; on CPU the worker's address space is capped
(`memory_budget_bytes`, `cap_address_space`) so that an allocation fails cleanly instead of waking the kernel's OOM
killer on a shared machine.
"""

import json
import resource
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

from optimum.habana.cli.common import is_out_of_memory, meminfo_bytes

from .tables import GB


RESULT_MARKER = "BENCHMARK_RESULT "
# Virtual memory the process may add beyond the cap's budget without holding it (thread stacks, malloc arenas).
_ADDRESS_SPACE_SLACK = 64 << 20


def memory_budget_bytes(memory_limit_gb: float | None, device: torch.device) -> int | None:
    """How much more each CPU worker may allocate: `--memory_limit_gb` (0: no cap), else 80% of what is available."""
    if device.type != "cpu":
        return None  # the device allocator fails cleanly on its own
    if memory_limit_gb is not None:
        return int(memory_limit_gb * GB) or None
    available = meminfo_bytes("MemAvailable")
    return int(available * 0.8) if available else None


def run_worker(task: dict[str, Any], timeout: float, worker: str) -> dict[str, Any]:
    """One measurement in a fresh process of the `worker` module: its result, or a timeout / OOM / error status."""
    command = [sys.executable, "-m", worker, json.dumps(task)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"still running after --timeout {timeout:g} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    if done.returncode == -9:
        return {"status": "oom", "error": "killed by SIGKILL (the kernel's OOM killer)"}
    lines = done.stderr.strip().splitlines()
    return {"status": "error", "error": lines[-1] if lines else f"exit code {done.returncode}"}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def cap_address_space(budget_bytes: int) -> None:
    """Let this process grow by about `budget_bytes` more, then fail allocations (CPU OOM as an exception)."""
    size = _status_kib("VmSize") * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + budget_bytes + _ADDRESS_SPACE_SLACK
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    return 0


def report_measurement(measure: Callable[[dict[str, Any]], dict[str, Any]], task: dict[str, Any]) -> int:
    """Print `measure(task)` on the marker line the parent reads; an OOM is a measurement (its cell says so, the
    grid goes on), anything else is a broken run, raised with its traceback. The task's `threads`, when given, is
    this process's torch thread count."""
    if task.get("threads"):
        torch.set_num_threads(task["threads"])
    try:
        result = measure(task)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        result = {"status": "oom", "error": str(error).strip().splitlines()[0][:300]}
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0
