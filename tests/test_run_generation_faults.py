"""run_generation.py under faults: out of memory and Ctrl-C give one line, an exit code, and no partial results."""

import os
import signal
import subprocess
import sys
import time

import torch

from .test_run_generation import (  # noqa: F401 (fixtures)
    SCRIPT,
    _use_module_cache,
    cache_dir,
    script,
    script_env,
    tiny_argv,
    tiny_checkpoint,
)


def test_out_of_memory_is_one_line_and_exit_1(script, tiny_checkpoint, tmp_path, monkeypatch, capsys):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(script, "benchmark", out_of_memory)
    output_dir = tmp_path / "results"
    assert script.main(tiny_argv(tiny_checkpoint, "--output_dir", str(output_dir))) == 1
    stderr = capsys.readouterr().err
    assert "out of cpu memory generating batch 3 x" in stderr and "Lower --batch_size" in stderr
    assert "Traceback" not in stderr
    assert not (output_dir / "results.json").exists()


def test_cpu_allocator_failure_counts_as_out_of_memory(script, tiny_checkpoint, monkeypatch, capsys):
    def cpu_allocator(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(script, "benchmark", cpu_allocator)
    assert script.main(tiny_argv(tiny_checkpoint)) == 1
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
    assert stderr.strip().splitlines()[-1] == "run_generation.py: interrupted; no results were written."
    assert "Traceback" not in stderr
    assert not output_dir.exists() or not any(output_dir.iterdir())
