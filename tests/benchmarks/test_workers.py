"""optimum.habana.cli.benchmarks.workers.run_command: a launch past its timeout, or interrupted, is stopped with every
process it started (torchrun's workers, a compile pool), not alone; real processes here, a second or two each."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from optimum.habana.cli.benchmarks import workers


# A parent that starts a child, writes the child's pid to argv[1], and waits on it: a launcher and its worker.
PARENT = (
    "import subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "open(sys.argv[1], 'w').write(str(child.pid))\n"
    "child.wait()\n"
)


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting for a parent that does not reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


@pytest.fixture
def child_pid_file(tmp_path: Path) -> Iterator[Path]:
    """Where the launched parent writes its child's pid; a child a failing test left behind is killed after it."""
    path = tmp_path / "child.pid"
    yield path
    if path.exists() and path.read_text() and alive(pid := int(path.read_text())):
        os.kill(pid, signal.SIGKILL)


def wait_for(path: Path) -> int:
    deadline = time.monotonic() + 30
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, "the launched process did not start its child"
        time.sleep(0.05)
    return int(path.read_text())


def test_a_launch_past_its_timeout_is_stopped_with_its_children(child_pid_file):
    command = [sys.executable, "-c", PARENT, str(child_pid_file)]
    with pytest.raises(subprocess.TimeoutExpired):
        workers.run_command(command, timeout=3.0, grace=1.0)
    child = wait_for(child_pid_file)
    assert gone_within(child, 5.0), "the launch's child outlived its timeout"


def test_an_interrupted_launch_is_stopped_with_its_children(child_pid_file, monkeypatch):
    """In a session of its own the launch does not get the terminal's Ctrl-C: run_command must stop it."""
    communicate = subprocess.Popen.communicate

    def interrupted(self, *args, **kwargs):
        wait_for(child_pid_file)
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "communicate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        workers.run_command([sys.executable, "-c", PARENT, str(child_pid_file)], timeout=60.0, grace=1.0)
    monkeypatch.setattr(subprocess.Popen, "communicate", communicate)
    assert gone_within(wait_for(child_pid_file), 5.0), "Ctrl-C left the launch's child running"


def test_a_finished_launch_gives_its_output_and_exit_status():
    done = workers.run_command([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout=30.0)
    assert (done.returncode, done.stdout) == (3, "out\n")


def test_run_worker_stops_its_worker_s_children_past_the_timeout(child_pid_file, monkeypatch):
    """run_worker's workers may start processes of their own (inductor's compile pool): it launches through
    run_command too."""
    launched = []

    def spy(command: list[str], timeout: float, grace: float = 1.0) -> subprocess.CompletedProcess:
        launched.append(command)
        return run_command([sys.executable, "-c", PARENT, str(child_pid_file)], timeout, grace=1.0)

    run_command = workers.run_command
    monkeypatch.setattr(workers, "run_command", spy)
    result = workers.run_worker({"path": "flash"}, 3.0, worker="some.worker")
    assert result == {"status": "timeout", "error": "still running after --timeout 3 s"}
    assert launched and launched[0][1:3] == ["-m", "some.worker"]
    assert gone_within(wait_for(child_pid_file), 5.0)
