"""One measurement per fresh process, so that its peak memory belongs to it alone: both ends of that protocol.

The parent script calls `run_worker` once per path and row; the worker module (`python -m <worker> '<json task>'`)
measures and ends with `report_measurement`, whose last stdout line is `RESULT_MARKER` followed by the JSON result.
A run that runs out of memory reports `"status": "oom"`; on CPU the worker's address space is capped
(`memory_budget_bytes`, `cap_address_space`) so that an allocation fails cleanly instead of waking the kernel's OOM
killer on a shared machine.

Every launch (`run_command`) starts in a session of its own, and a launch past its timeout, or interrupted, is
stopped as a whole process group: a worker's own children (torchrun's processes, inductor's compile workers) do not
outlive it.
"""

import contextlib
import json
import os
import resource
import signal
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
# Seconds a stopped launch gets between SIGTERM (torchrun passes it on to its workers) and SIGKILL.
STOP_GRACE_SECONDS = 5.0


def memory_budget_bytes(memory_limit_gb: float | None, device: torch.device) -> int | None:
    """How much more each CPU worker may allocate: `--memory_limit_gb` (0: no cap), else 80% of what is available."""
    if device.type != "cpu":
        return None  # the device allocator fails cleanly on its own
    if memory_limit_gb is not None:
        return int(memory_limit_gb * GB) or None
    available = meminfo_bytes("MemAvailable")
    return int(available * 0.8) if available else None


def run_command(
    command: list[str], timeout: float, grace: float = STOP_GRACE_SECONDS
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(command, capture_output=True, text=True, timeout=timeout)`, but in a session of its own, so
    that past the timeout (`subprocess.TimeoutExpired`, raised once everything is stopped), on Ctrl-C or on any other
    exception the whole process group is stopped, not the launched process alone: subprocess.run's SIGKILL of
    torchrun left its workers running, orphaned. (In its own session the launch no longer gets the terminal's Ctrl-C:
    this process passes it on as SIGTERM.)"""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:
        stop_process_group(process, grace)
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def stop_process_group(process: subprocess.Popen[str], grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM to the group that `process` leads (its own session), up to `grace` seconds for it to end, then
    SIGKILL to whatever of the group is left (even when a second Ctrl-C cuts the wait short); its pipes closed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    finally:
        # Linux keeps the group's id from reuse while any member lives, so this reaches the leader's children even
        # once the leader itself is reaped; ProcessLookupError: none is left.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


def run_worker(task: dict[str, Any], timeout: float, worker: str) -> dict[str, Any]:
    """One measurement in a fresh process of the `worker` module: its result, or a timeout / OOM / error status."""
    command = [sys.executable, "-m", worker, json.dumps(task)]
    try:
        done = run_command(command, timeout)
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
