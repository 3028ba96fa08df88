"""benchmark_context_parallel.py: its refusals, its documented commands, its result files (never replacing earlier
ones unasked, written after every cell, kept on Ctrl-C), and its table and longest lengths from measured cells (the
launches are stood in for here: a real run takes minutes, see docs/multi_device.md)."""

import json
import re
import shlex
import subprocess
from typing import Any

import pytest

from optimum.habana.cli.benchmarks import workers
from tests.helpers import ROOT, load_script


TINY = ["--model", "llama3-8b-attn", "--layers", "1", "--intermediate_size", "64", "--tokens", "64",
        "--sizes", "1", "2", "--timed_steps", "0"]  # fmt: skip
GIB = 1024**3


@pytest.fixture(scope="module")
def script():
    return load_script("examples/language-modeling/benchmark_context_parallel.py")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "smollm2-attn", "--sizes", "2"], "--sizes 2: smollm2-attn has 9 heads, which 2 must divide."),
        (
            ["--model", "llama3-8b-attn", "--sizes", "4", "--tokens", "2"],
            "--tokens: every length must be at least the largest of --sizes (4).",
        ),
        (["--threads", "0", "--sizes", "1"], "--threads must be at least 1, got 0."),
        (["--memory_limit_gb", "-1", "--sizes", "1"], "--memory_limit_gb must be 0 (no cap) or more, got -1.0."),
        (["--timed_steps", "-1", "--sizes", "1"], "--timed_steps must be 0 (memory only) or more, got -1."),
        (["--threads", "-1", "--sizes", "1"], "--threads must be at least 1, got -1."),
        (["--timeout", "0", "--sizes", "1"], "--timeout must be a positive number of seconds, got 0.0."),
        (["--timeout", "-5", "--sizes", "1"], "--timeout must be a positive number of seconds, got -5.0."),
        (["--timeout", "inf", "--sizes", "1"], "--timeout must be a positive number of seconds, got inf."),
    ],
)
def test_values_that_cannot_run_are_refused_in_one_line(script, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(script, "launch", lambda *args: pytest.fail("a launch ran"))
    with pytest.raises(SystemExit) as stopped:
        script.main(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"benchmark_context_parallel.py: error: {message}\n"


def test_the_table_compares_each_split_with_one_process_and_names_the_longest_lengths(script):
    gib = 1024**3
    cells = [
        {"tokens": 2048, "size": 1, "status": "ok", "peak_memory_bytes": 3 * gib, "extra_memory_bytes": 2 * gib,
         "tokens_per_second": 50.0},
        {"tokens": 2048, "size": 2, "status": "ok", "peak_memory_bytes": 2 * gib, "extra_memory_bytes": 1 * gib,
         "tokens_per_second": 80.0},
        {"tokens": 4096, "size": 1, "status": "oom"},
        {"tokens": 4096, "size": 2, "status": "ok", "peak_memory_bytes": 3 * gib, "extra_memory_bytes": 2 * gib,
         "tokens_per_second": 70.0},
        {"tokens": 8192, "size": 1, "status": "ok", "peak_memory_bytes": 8 * gib, "extra_memory_bytes": 6 * gib,
         "tokens_per_second": None},  # --timed_steps 0: memory only
        {"tokens": 8192, "size": 2, "status": "ok", "peak_memory_bytes": 5 * gib, "extra_memory_bytes": 3 * gib,
         "tokens_per_second": None},
    ]  # fmt: skip
    rows = [cells_of(line) for line in script.table(cells).splitlines()[2:]]
    assert rows[1] == ["2048", "2", "2.00", "1.00", "0.50", "0.67", "80.0"]
    assert rows[2] == ["4096", "1", "oom", "-", "-", "-", "-"]
    assert rows[3][4:6] == ["-", "-"]  # no one-process cell to compare with
    assert rows[5] == ["8192", "2", "5.00", "3.00", "0.50", "0.62", "-"]
    assert script.longest(cells, [1, 2]) == "- 1 process(es): 8192\n- 2 process(es): 8192"


def cells_of(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def documented_commands() -> list[list[str]]:
    """The script's command lines in its docstring and in docs/benchmarks.md, as argument lists."""
    texts = [(ROOT / "examples/language-modeling/benchmark_context_parallel.py").read_text().replace("\\\\\n", " ")]
    texts.append((ROOT / "docs/benchmarks.md").read_text().replace("\\\n", " "))
    pattern = r"python examples/language-modeling/benchmark_context_parallel\.py([^\n`]*)"
    return [shlex.split(match) for text in texts for match in re.findall(pattern, text)]


def test_the_defaults_and_every_documented_command_pass_the_script_s_own_checks(script):
    commands = documented_commands()
    assert len(commands) >= 4  # the docstring's and the three of docs/benchmarks.md
    parser = script.build_parser()
    for argv in [[], *commands]:
        arguments = parser.parse_args(argv)
        script.check_arguments(parser, arguments)  # SystemExit(2) here: a command its own check refuses
    assert parser.parse_args([]).model == "llama3-8b-attn"


def test_the_table_s_columns_are_the_ones_docs_benchmarks_md_shows(script):
    cell = {"tokens": 64, "size": 1, "status": "ok", "peak_memory_bytes": GIB, "extra_memory_bytes": GIB,
            "tokens_per_second": 1.0}  # fmt: skip
    printed = cells_of(script.table([cell]).splitlines()[0])
    docs = (ROOT / "docs/benchmarks.md").read_text()
    section = docs.split("## Context parallelism: one sequence over processes", 1)[1]
    documented = cells_of(next(line for line in section.splitlines() if line.startswith("| tokens")))
    assert printed == documented
    assert "tokens/s (all processes)" in printed  # the whole sequence's tokens over the step


def fake_launch(calls: list[tuple[int, int]], interrupt_at: int | None = None) -> Any:
    """A stand-in for one torchrun launch: a measured cell, or Ctrl-C at launch number `interrupt_at`."""

    def launch(task: dict[str, Any], size: int, timeout: float) -> dict[str, Any]:
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        calls.append((task["tokens"], size))
        return {"status": "ok", "peak_memory_bytes": 2 * GIB, "extra_memory_bytes": GIB // size,
                "tokens_per_second": 10.0 * size}  # fmt: skip

    return launch


def test_earlier_results_are_refused_before_anything_runs_unless_overwrite(script, tmp_path, capsys, monkeypatch):
    (tmp_path / "results.json").write_text('{"precious": "earlier results"}')
    (tmp_path / "results.md").write_text("# earlier report\n")
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(script, "launch", fake_launch(calls))
    with pytest.raises(SystemExit) as stopped:
        script.main([*TINY, "--output_dir", str(tmp_path)])
    assert stopped.value.code == 2 and calls == []
    assert capsys.readouterr().err == (
        f"benchmark_context_parallel.py: error: --output_dir {tmp_path} already holds results.json, results.md: "
        "choose another folder, or pass --overwrite to replace them.\n"
    )
    assert (tmp_path / "results.json").read_text() == '{"precious": "earlier results"}'

    atomic_writes = []
    write = script.atomic_write_text
    monkeypatch.setattr(
        script, "atomic_write_text", lambda path, text: atomic_writes.append(path.name) or write(path, text)
    )
    assert script.main([*TINY, "--output_dir", str(tmp_path), "--overwrite"]) == 0
    assert set(atomic_writes) == {"results.json", "results.md"}  # a reader never sees half a file
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["complete"] is True and [(c["tokens"], c["size"]) for c in results["cells"]] == [(64, 1), (64, 2)]
    assert (tmp_path / "results.md").read_text().startswith("`llama3-8b-attn")


def test_ctrl_c_is_one_line_and_keeps_the_cells_measured_marked_incomplete(script, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(script, "launch", fake_launch([], interrupt_at=1))
    try:
        script.main([*TINY, "--output_dir", str(tmp_path)])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped as a KeyboardInterrupt traceback")
    except SystemExit as stopped:
        assert stopped.code == 130
    else:
        pytest.fail("the run went on after Ctrl-C")
    assert capsys.readouterr().err.strip().splitlines() == [
        f"benchmark_context_parallel.py: interrupted: the measurements so far are in {tmp_path / 'results.json'}, "
        f"{tmp_path / 'results.md'}, marked incomplete."
    ]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["complete"] is False and [(c["tokens"], c["size"]) for c in results["cells"]] == [(64, 1)]
    report = (tmp_path / "results.md").read_text()
    assert report.startswith("**INCOMPLETE**: the run stopped before its end") and "| 64 " in report


def test_a_launch_past_its_timeout_is_stopped_as_a_process_group(script, monkeypatch):
    """torchrun's workers are its children: the launch goes through workers.run_command, which stops them all
    (tests/benchmarks/test_workers.py), never through subprocess.run, which kills torchrun alone."""
    commands = []

    def past_timeout(command: list[str], timeout: float) -> subprocess.CompletedProcess:
        commands.append(command)
        raise subprocess.TimeoutExpired(command, timeout)

    monkeypatch.setattr(workers, "run_command", past_timeout)
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: pytest.fail("subprocess.run kills torchrun alone"))
    result = script.launch({"tokens": 64}, 2, 3.0)
    assert result == {"status": "timeout", "error": "still running after --timeout 3 s"}
    assert commands[0][1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
