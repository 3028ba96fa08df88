"""Smoke test of examples/language-modeling/benchmark_packed_step.py: a fresh process per path, the table, the
ratios to the floor. No timing assertions. The script's main runs in this process; its workers in their own, but for
the compiled step's."""

import subprocess

import pytest
import torch

from optimum.habana.cli.benchmarks import workers
from tests.helpers import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("examples/language-modeling/benchmark_packed_step.py")


def test_packed_step_table_has_every_path_and_its_ratio_to_the_floor(script, capsys):
    argv = ["--layers", "1", "--intermediate_size", "64", "--examples", "2", "--example_tokens", "16"]
    argv += ["--paths", "floor", "flash", "--threads", "1"]
    assert script.main(argv) == 0, capsys.readouterr().err[-3000:]
    lines = capsys.readouterr().out.splitlines()
    assert "2 examples x 16 tokens packed into one row of 32" in lines[0]
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ") and "Path" not in line}
    assert set(rows) == {"floor", "flash"}
    floor_cells = [cell.strip() for cell in rows["floor"].strip("|").split("|")]
    assert floor_cells[3] == "1.00"  # the floor against itself
    for path in ("flash",):
        cells = [cell.strip() for cell in rows[path].strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[3]) > 0


def test_a_compiled_padded_step_is_measured(script, capsys, monkeypatch, threads):
    """The worker in this process (the test above runs them in their own; a process costs seconds of imports)."""

    def in_this_process(path: str, argv: list[str], timeout: float) -> dict:
        return {"status": "ok", **script.measure(script.parse_arguments([*argv, "--worker", path]))}

    monkeypatch.setattr(script, "run_path", in_this_process)
    threads(torch.get_num_threads())  # the worker sets --threads 1: restored after the test
    argv = [
        "--layers",
        "1",
        "--intermediate_size",
        "64",
        "--examples",
        "2",
        "--example_tokens",
        "16",
        "--threads",
        "1",
    ]
    argv += ["--paths", "flash", "--batch", "padded", "--torch_compile", "--torch_compile_backend", "eager"]
    assert script.main(argv) == 0, capsys.readouterr().err[-3000:]
    lines = capsys.readouterr().out.splitlines()
    assert "2 examples x 16 tokens right-padded, one row each" in lines[0]
    assert "torch.compile (eager, fullgraph)" in lines[0]
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ") and "Path" not in line}
    assert set(rows) == {"flash"}
    assert float(rows["flash"].strip("|").split("|")[1]) > 0  # a step time, not "failed" or "timeout"


def test_bad_values_are_usage_errors(script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--examples", "0"])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--examples must be at least 1, got 0" in stderr
    assert "Traceback" not in stderr
    with pytest.raises(SystemExit):
        script.main(["--torch_compile_backend", "eager"])
    assert "--torch_compile_backend eager picks the backend: add --torch_compile." in capsys.readouterr().err


def test_ctrl_c_is_one_line(script, capsys, monkeypatch):
    def interrupted(path, argv, timeout):
        raise KeyboardInterrupt

    monkeypatch.setattr(script, "run_path", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--paths", "floor"])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "benchmark_packed_step.py: interrupted: nothing was written (the table is printed once every path is "
        "measured)."
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--threads", "-1"], "--threads must be at least 1, got -1 (leave it out for torch's own count)."),
        (["--threads", "0"], "--threads must be at least 1, got 0 (leave it out for torch's own count)."),
        (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0."),
        (["--timeout", "-5"], "--timeout must be a positive number of seconds, got -5.0."),
    ],
)
def test_threads_and_timeout_that_cannot_run_are_one_line_before_any_path(script, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(script, "run_path", lambda *args: pytest.fail("a path ran"))
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"benchmark_packed_step.py: error: {message}\n"


def test_a_path_past_its_timeout_is_stopped_as_a_process_group(script, monkeypatch):
    """A compiled step's worker starts inductor's compile workers: the launch goes through workers.run_command, which
    stops them all (tests/benchmarks/test_workers.py), never through subprocess.run, which kills the worker alone."""
    commands = []

    def past_timeout(command: list[str], timeout: float) -> subprocess.CompletedProcess:
        commands.append(command)
        raise subprocess.TimeoutExpired(command, timeout)

    monkeypatch.setattr(workers, "run_command", past_timeout)
    monkeypatch.setattr(
        subprocess, "run", lambda *args, **kwargs: pytest.fail("subprocess.run kills the worker alone")
    )
    assert script.run_path("flash", ["--paths", "flash"], 3.0) == {"status": "timeout"}
    assert commands[0][-2:] == ["--worker", "flash"]
