"""Smoke test of examples/language-modeling/benchmark_packed_step.py: a fresh process per path, the table, the
ratios to the floor. No timing assertions."""

import subprocess
import sys

from tests.helpers import ROOT


SCRIPT = ROOT / "examples" / "language-modeling" / "benchmark_packed_step.py"


def test_packed_step_table_has_every_path_and_its_ratio_to_the_floor():
    argv = ["--layers", "1", "--intermediate_size", "64", "--examples", "2", "--example_tokens", "16"]
    argv += ["--paths", "floor", "flash", "--threads", "1"]
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "2 examples x 16 tokens packed into one row of 32" in lines[0]
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ") and "Path" not in line}
    assert set(rows) == {"floor", "flash"}
    floor_cells = [cell.strip() for cell in rows["floor"].strip("|").split("|")]
    assert floor_cells[3] == "1.00"  # the floor against itself
    for path in ("flash",):
        cells = [cell.strip() for cell in rows[path].strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[3]) > 0


def test_bad_values_are_usage_errors():
    done = subprocess.run([sys.executable, str(SCRIPT), "--examples", "0"], capture_output=True, text=True)
    assert done.returncode == 2 and "--examples must be at least 1, got 0" in done.stderr
    assert "Traceback" not in done.stderr
