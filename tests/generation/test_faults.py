"""run_generation.py under faults: out of memory and Ctrl-C give one line, an exit code, and no partial results."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.generation.support import SCRIPT, script_env, tiny_argv


def test_out_of_memory_is_one_line_and_exit_1(script, tiny_checkpoint, tmp_path, monkeypatch, capsys):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(script, "benchmark", out_of_memory)
    output_dir = tmp_path / "results"
    with pytest.raises(SystemExit) as exit_info:
        script.main(tiny_argv(tiny_checkpoint, "--output_dir", str(output_dir)))
    assert exit_info.value.code == 1
    stderr = capsys.readouterr().err
    assert "out of cpu memory generating batch 3 x" in stderr and "Lower --batch_size" in stderr
    assert "Traceback" not in stderr
    assert not (output_dir / "results.json").exists()


def test_cpu_allocator_failure_counts_as_out_of_memory(script, tiny_checkpoint, monkeypatch, capsys):
    def cpu_allocator(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(script, "benchmark", cpu_allocator)
    with pytest.raises(SystemExit) as exit_info:
        script.main(tiny_argv(tiny_checkpoint))
    assert exit_info.value.code == 1
    assert "out of cpu memory" in capsys.readouterr().err


def test_ctrl_c_exits_130_with_one_line_and_no_results(tiny_checkpoint, cache_dir, tmp_path):
    output_dir = tmp_path / "results"
    argv = tiny_argv(tiny_checkpoint, "--max_new_tokens", "60", "--n_iterations", "1000")
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), *argv, "--output_dir", str(output_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=script_env(cache_dir),
    )
    header = process.stdout.readline()  # printed once the model is loaded, right before generating
    assert header.startswith("Model:"), process.communicate()
    time.sleep(1)
    os.kill(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    assert stderr.strip().splitlines()[-1] == "run_generation.py: interrupted: no results were written."
    assert "Traceback" not in stderr
    assert not (output_dir / "results.json").exists()


def test_earlier_results_are_never_overwritten_unasked(script, tiny_checkpoint, tmp_path, capsys):
    output_dir = tmp_path / "results"
    argv = tiny_argv(tiny_checkpoint, "--output_dir", str(output_dir))
    assert script.main(argv) == 0
    first = (output_dir / "results.json").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        script.main([*argv, "--max_new_tokens", "2"])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert "is not empty (results.json): refusing to overwrite an earlier run" in stderr
    assert "--overwrite_output_dir" in stderr and "Loading weights" not in stderr  # refused before loading
    assert (output_dir / "results.json").read_text() == first
    assert script.main([*argv, "--max_new_tokens", "2", "--overwrite_output_dir"]) == 0
    assert (output_dir / "results.json").read_text() != first


def test_results_replace_a_symlink_instead_of_writing_through_it(script, tiny_checkpoint, tmp_path):
    output_dir, elsewhere = tmp_path / "results", tmp_path / "elsewhere.json"
    output_dir.mkdir()
    elsewhere.write_text("keep me")
    (output_dir / "results.json").symlink_to(elsewhere)
    argv = tiny_argv(tiny_checkpoint, "--output_dir", str(output_dir), "--overwrite_output_dir")
    assert script.main(argv) == 0
    assert elsewhere.read_text() == "keep me"
    assert not (output_dir / "results.json").is_symlink() and "throughput" in (output_dir / "results.json").read_text()


def test_an_output_dir_that_cannot_be_written_fails_before_loading(script, tiny_checkpoint, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        script.main(tiny_argv(tiny_checkpoint, "--output_dir", str(tmp_path / "a_file")))
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert "--output_dir" in stderr and "is a file, not a folder" in stderr and "Loading weights" not in stderr


def test_results_another_run_wrote_meanwhile_are_kept(script, tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """Two runs started into one empty --output_dir both passed its check; the second to finish replaced the first's
    results.json while the first said it had written it. The later one now takes results-1.json, and says so."""
    output_dir = tmp_path / "results"
    document = script.results_document

    def another_run_finishes_first(*args, **kwargs):
        (output_dir / "results.json").write_text('{"another": "run"}')
        return document(*args, **kwargs)

    monkeypatch.setattr(script, "results_document", another_run_finishes_first)
    assert script.main(tiny_argv(tiny_checkpoint, "--output_dir", str(output_dir))) == 0
    assert json.loads((output_dir / "results.json").read_text()) == {"another": "run"}
    assert "throughput" in json.loads((output_dir / "results-1.json").read_text())
    captured = capsys.readouterr()
    assert f"Results written to {output_dir / 'results-1.json'}" in captured.out
    assert "results.json appeared during the run (another run's?) and is kept." in captured.err
