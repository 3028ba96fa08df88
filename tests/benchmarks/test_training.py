"""Smoke test of examples/language-modeling/benchmark_training.py: a fresh process per row and path, the tables,
the ratios to the floor, the JSON/CSV/Markdown files, usage errors. No timing assertions.

Each process costs several seconds of imports (torch, transformers, PEFT), so the real run is one row with the
floor and flash; the other paths, full fine-tuning, checkpointing off and padded batches run through the worker's
own function in this process, and a grid of every row kind, the OOM/timeout/error cells and the flash / sdpa
column through the script's main with a stand-in worker.
"""

import csv
import itertools
import json
import math
import os
import platform
from collections.abc import Callable

import pytest

from optimum.habana.cli.benchmarks.training import worker
from tests import helpers
from tests.helpers import ROOT


ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
TINY = ["--layers", "1", "--intermediate_size", "64", "--threads", "1"]


def load_script():
    return helpers.load_script("examples/language-modeling/benchmark_training.py")


def table(stdout: str, title: str) -> list[dict[str, str]]:
    """The Markdown table printed under `title`, as one dict per row."""
    lines = stdout.split(title, 1)[1].splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("|"))
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    header, *body = ([cell.strip() for cell in row.strip("|").split("|")] for row in rows)
    return [dict(zip(header, cells, strict=True)) for cells in body[1:]]  # body[0] is the |---| line


def test_smoke_run_measures_a_row_in_a_fresh_process_per_path_and_writes_its_files(tmp_path, monkeypatch, capsys):
    """The script's main in this process (its imports are paid once); each path's worker in a fresh one."""
    argv = [*TINY, "--tokens", "16", "--paths", "floor", "flash", "--modes", "lora", "--gradient_checkpointing", "on"]
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])  # the workers import this checkout
    assert load_script().main([*argv, "--output_dir", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out

    (memory,) = table(stdout, "Extra memory of the step over the built model")
    assert list(memory) == ["Model", "Tokens", "Batch", "Mode", "GC", "floor", "flash"]
    assert (memory["Model"], memory["Tokens"], memory["Batch"], memory["Mode"], memory["GC"]) == (
        "smollm2-attn",
        "16",
        "1",
        "lora",
        "on",
    )
    assert memory["floor"].endswith("(1.00×)")  # the floor against itself
    assert float(memory["flash"].split()[0]) > 0 and memory["flash"].endswith("×)")
    (time,) = table(stdout, "Step time, forward + backward")
    assert float(time["floor"].split()[0]) > 0 and float(time["flash"].split()[0]) > 0
    assert "Flash extra memory <= 1.1× the floor's with gradient checkpointing: " in stdout

    report = json.loads((tmp_path / "results.json").read_text())
    assert report["complete"] is True and len(report["rows"]) == 1
    (row,) = report["rows"]
    assert set(row["paths"]) == {"floor", "flash"} and row["extra_vs_floor"]["floor"] == 1.0
    for result in row["paths"].values():
        assert result["status"] == "ok" and result["real_tokens"] == 16 and math.isfinite(result["loss"])
        assert result["step_seconds"] > 0 and result["extra_memory_bytes"] > 0
        assert result["fixed_mmap_threshold"] is (platform.libc_ver()[0] == "glibc")
    with open(tmp_path / "results.csv", newline="") as file:
        (line,) = csv.DictReader(file)
    assert float(line["flash extra [GiB]"]) > 0 and line["floor extra / floor"] == "1.000"
    assert "| smollm2-attn |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "training.png").read_bytes().startswith(b"\x89PNG")


def stand_in_worker(calls: list[tuple]) -> Callable[[dict, float], dict]:
    """Results that follow from the task (no process, no model): the floor 1, flash 1.05, sdpa 1.1, ..."""
    factors = {"floor": 1.0, "flash": 1.05, "default": 2.0, "sdpa": 1.1, "eager": 3.0}

    def run(task: dict, timeout: float) -> dict:
        calls.append((task["tokens"], task["padding"], task["mode"], task["gradient_checkpointing"], task["path"]))
        size = task["tokens"] * factors[task["path"]]
        return {
            "status": "ok",
            "step_seconds": size / 100,
            "tokens_per_second": 100 / factors[task["path"]],
            "peak_memory_bytes": int(size * 2**21),
            "extra_memory_bytes": int(size * 2**20),
        }

    return run


def test_grid_has_a_row_per_length_padding_mode_and_checkpointing_and_a_column_per_path(tmp_path, monkeypatch, capsys):
    script, calls = load_script(), []
    monkeypatch.setattr(script, "run_worker", stand_in_worker(calls))
    argv = ["--tokens", "32", "16", "--batch_size", "2", "--padded", "none", "left", "--output_dir", str(tmp_path)]
    assert script.main(argv) == 0
    out = capsys.readouterr().out

    rows = [
        (tokens, padding, mode, gc)  # the grid's order: lengths vary fastest, shortest first
        for padding in ("none", "left")
        for mode in ("lora", "full")
        for gc in (True, False)
        for tokens in (16, 32)
    ]
    assert len(rows) == 16 and len(calls) == 16 * 5
    for index, row in enumerate(rows):  # every row's paths in a row, their order reversed every other row
        paths = [call[-1] for call in calls[5 * index : 5 * index + 5]]
        assert {call[:-1] for call in calls[5 * index : 5 * index + 5]} == {row}
        assert paths == (list(script.PATHS) if index % 2 == 0 else list(script.PATHS)[::-1])
    memory = table(out, "Extra memory of the step over the built model")
    assert [(int(r["Tokens"]), r["Batch"], r["Mode"], r["GC"]) for r in memory] == [
        (tokens, "2" if padding == "none" else "2, left-padded", mode, "on" if gc else "off")
        for tokens, padding, mode, gc in rows
    ]
    assert {r["flash"].split()[1] for r in memory} == {"(1.05×)"} and {r["floor"].split()[1] for r in memory} == {
        "(1.00×)"
    }
    assert {r["flash / sdpa"] for r in table(out, "Step time, forward + backward")} == {"0.95"}
    assert (
        "Flash extra memory <= 1.1× the floor's with gradient checkpointing: met; highest 1.05× over 8 row(s)" in out
    )
    assert "Flash step time <= stock sdpa's: met" in out

    report = json.loads((tmp_path / "results.json").read_text())
    assert len(report["rows"]) == 16 and all(set(row["paths"]) == set(script.PATHS) for row in report["rows"])
    with open(tmp_path / "results.csv", newline="") as file:
        lines = list(csv.DictReader(file))
    assert len(lines) == 16
    assert {line["default extra / floor"] for line in lines} == {"2.000"}
    assert {line["flash step / sdpa step"] for line in lines} == {"0.955"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokens", "1024", "0"], "--tokens must be at least 1, got 0"),
        (["--padded", "left"], "--padded left needs --batch_size 2 or more"),
        (["--batch_size", "2", "--padded", "right", "--tokens", "2"], "--padded right needs --tokens of at least 4"),
        (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
        (["--memory_limit_gb", "-1"], "--memory_limit_gb must be 0 (no cap) or more"),
        (["--layers", "0"], "--layers must be at least 1, got 0"),
    ],
)
def test_bad_values_are_refused_before_any_work(argv, message, capsys):
    script = load_script()
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in error and "Traceback" not in error


def test_output_dir_with_earlier_results_is_refused(tmp_path, capsys):
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        load_script().main(["--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "--overwrite" in capsys.readouterr().err


@pytest.mark.parametrize(
    "path, mode, checkpointing, padding",
    [("flash", "full", False, "left"), ("default", "lora", True, "right")]
    + [("sdpa", "full", True, "right"), ("eager", "lora", False, "none")],
)
def test_worker_trains_every_mode_and_padding(path, mode, checkpointing, padding, monkeypatch):
    monkeypatch.setattr(worker, "set_mmap_threshold", lambda size: False)  # leave this process's malloc alone
    task = {
        "model": {"name": "smollm2-attn", "preset_layers": 1, "preset_intermediate_size": 64},
        "path": path,
        "mode": mode,
        "gradient_checkpointing": checkpointing,
        "batch_size": 2,
        "tokens": 16,
        "padding": padding,
        "seed": 0,
    }
    result = worker.measure_training(task)
    assert result["status"] == "ok" and math.isfinite(result["loss"])
    assert result["real_tokens"] == (32 if padding == "none" else 16 + 12)  # the second row is 3/4 long
    lora_parameters = 2 * 8 * (576 + 576) + 2 * 8 * (576 + 192)  # q/o and k/v projections, rank 8, one layer
    if mode == "lora":
        assert result["trainable_parameters"] == lora_parameters
    else:
        assert result["trainable_parameters"] > 100 * lora_parameters


def test_padded_batch_masks_the_shorter_row_on_its_side():
    for side, masked in (("left", slice(0, 4)), ("right", slice(12, 16))):
        batch = worker.training_batch(2, 16, side, vocab_size=100, pad_token_id=0, seed=0)
        assert batch["attention_mask"][0].all() and int(batch["attention_mask"][1].sum()) == 12
        assert not batch["attention_mask"][1, masked].any() and (batch["labels"][1, masked] == -100).all()


def test_oom_and_timeout_are_cells_and_any_other_failure_exits_1(tmp_path, monkeypatch, capsys):
    script = load_script()
    outcomes = {
        "floor": {"status": "ok", "step_seconds": 2.0, "tokens_per_second": 8.0, "peak_memory_bytes": 2 << 30}
        | {"extra_memory_bytes": 1 << 30},
        "flash": {"status": "ok", "step_seconds": 3.0, "tokens_per_second": 5.0, "peak_memory_bytes": 2 << 30}
        | {"extra_memory_bytes": 1 << 30},
        "default": {"status": "oom", "error": "DefaultCPUAllocator: can't allocate memory"},
        "sdpa": {"status": "timeout", "error": "still running after --timeout 5 s"},
        "eager": {"status": "error", "error": "RuntimeError: boom"},
    }
    monkeypatch.setattr(script, "run_worker", lambda task, timeout: outcomes[task["path"]])
    code = script.main(["--tokens", "16384", "--modes", "lora", "--gradient_checkpointing", "on"])
    out, err = capsys.readouterr()
    assert code == 1
    row = table(out, "Extra memory of the step over the built model")[0]
    assert (row["floor"], row["flash"], row["default"], row["sdpa"], row["eager"]) == (
        "1.000 (1.00×)",
        "1.000 (1.00×)",
        "OOM",
        "timeout",
        "error",
    )
    time = table(out, "Step time, forward + backward")[0]
    assert (time["flash"], time["sdpa"], time["flash / sdpa"]) == ("3.00 (1.50×)", "timeout", "-")
    assert "Flash trains at 16384+ tokens where the default path runs out of memory: met" in out
    assert "Flash step time vs stock sdpa: not measured" in out
    assert "smollm2-attn, 16384 tokens, BS 1, lora, GC on, eager path: RuntimeError: boom" in err
    assert "1 run(s) failed for a reason other than OOM or timeout" in err


def test_ctrl_c_is_one_line_and_every_file_written_so_far_is_marked_incomplete(tmp_path, monkeypatch, capsys):
    script, calls = load_script(), []
    measured = stand_in_worker(calls)

    def first_row_then_ctrl_c(task: dict, timeout: float) -> dict:
        if len(calls) == len(script.PATHS):
            raise KeyboardInterrupt
        return measured(task, timeout)

    monkeypatch.setattr(script, "run_worker", first_row_then_ctrl_c)
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--tokens", "16", "32", "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    files = ", ".join(str(tmp_path / name) for name in ("results.json", "results.csv", "results.md"))
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"benchmark_training.py: interrupted: the measurements so far are in {files}, marked incomplete."
    )
    assert json.loads((tmp_path / "results.json").read_text())["complete"] is False
    with open(tmp_path / "results.csv", newline="") as file:
        assert {line["complete"] for line in csv.DictReader(file)} == {"no"}
    assert (tmp_path / "results.md").read_text().startswith("**INCOMPLETE**: the run stopped before its end")
    assert not (tmp_path / "training.png").exists()


def test_a_grid_without_the_floor_s_memory_still_writes_its_files_and_plot(tmp_path, monkeypatch, capsys):
    """The floor timed out, so no path has an extra-memory ratio: the plot's empty panel must not fail the last
    write (it did: matplotlib's "cannot be log-scaled" traceback after every measurement was made)."""
    script = load_script()
    flash = {"status": "ok", "step_seconds": 3.0, "tokens_per_second": 5.0, "peak_memory_bytes": 2 << 30}
    outcomes = {"floor": {"status": "timeout", "error": "still running"}, "flash": flash | {"extra_memory_bytes": 1}}
    monkeypatch.setattr(script, "run_worker", lambda task, timeout: outcomes[task["path"]])
    argv = ["--tokens", "16", "--modes", "lora", "--paths", "floor", "flash", "--output_dir", str(tmp_path)]
    assert script.main(argv) == 0
    assert json.loads((tmp_path / "results.json").read_text())["complete"] is True
    assert (tmp_path / "training.png").read_bytes().startswith(b"\x89PNG")
