"""run_lora_clm.py --context_parallel_size: two processes under torchrun train as one process does."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.finetuning.support import SCRIPT, run_script, script_args
from tests.helpers import free_port


STEPS = "--do_train --max_steps 3 --per_device_train_batch_size 2 --logging_steps 1 --learning_rate 1e-2"
# LoRA's dropout draws its masks per process, over each process's positions: off, so that the runs compare exactly.
EXACT = "--use_cpu --max_seq_length 64 --lora_dropout 0"


def logged_losses(output_dir) -> list[float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def launcher_arguments(launcher: str) -> list[str]:
    """torchrun, or DeepSpeed's launcher (the `deepspeed` command), which sets the same variables and adds
    --local_rank=i; it takes no port 0 (its default port hung beside other launches)."""
    if launcher == "torchrun":
        return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return ["-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port())]


@pytest.mark.parametrize(
    "launcher",
    [
        "torchrun",
        pytest.param(
            "deepspeed",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is optional: pip install deepspeed"
            ),
        ),
    ],
)
def test_two_processes_splitting_each_sequence_train_as_one_process(script, checkpoint, tmp_path, launcher):
    one, two = tmp_path / "one", tmp_path / "two"
    argv = [*STEPS.split(), *EXACT.split(), "--use_flash_attention"]
    alone = run_script(script, script_args(checkpoint, one, *argv))
    command = [sys.executable, *launcher_arguments(launcher), str(SCRIPT)]
    command += script_args(checkpoint, two, *argv, "--context_parallel_size", "2")
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert alone.counts["fused"] > 0 and alone.counts["default"] == 0
    assert "2 processes (context parallel 2: each sequence split over 2 processes)" in done.stdout
    expected, found = alone.losses, logged_losses(two)
    assert len(found) == len(expected) == 3
    assert found == pytest.approx(expected, rel=1e-4)
    adapter, split_adapter = load_file(one / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors")
    assert adapter.keys() == split_adapter.keys()
    for name, weight in adapter.items():  # three optimizer steps on the same gradients
        assert (split_adapter[name] - weight).abs().max() <= 1e-5 * weight.abs().max(), name
