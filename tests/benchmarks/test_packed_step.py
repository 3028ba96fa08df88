"""Smoke test of examples/language-modeling/benchmark_packed_step.py: a fresh process per path, the table, the
ratios to the floor. No timing assertions. The script's main runs in this process; its workers in their own, but for
the compiled step's."""

import pytest
import torch

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
