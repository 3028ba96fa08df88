"""run_lora_clm.py --context_parallel_size: two processes under torchrun train as one process does."""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from transformers import TrainingArguments

from tests.families.support import save_family_checkpoint
from tests.finetuning.support import SCRIPT, run_script, script_args
from tests.helpers import free_port


# An epoch of 9 examples: 5 batches, which 2 processes do not divide, the last one smaller (accelerate's even batches
# trained a sixth, repeated, and completed the fifth with the first example).
STEPS = (
    "--do_train --num_train_epochs 1 --max_train_samples 9 --per_device_train_batch_size 2 --logging_steps 1 "
    "--learning_rate 1e-2"
)
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
    assert len(found) == len(expected) == 5
    assert found == pytest.approx(expected, rel=1e-4)
    adapter, split_adapter = load_file(one / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors")
    assert adapter.keys() == split_adapter.keys()
    for name, weight in adapter.items():  # five Adam steps on the same gradients, to float rounding
        assert (split_adapter[name] - weight).abs().max() <= 1e-4 * weight.abs().max(), name


class LoadedTheModel(Exception):
    """Raised where the script would load the weights: the run got past every check made before."""


@pytest.mark.parametrize(
    ("model_type", "packed", "refused"),
    [("llama4_text", True, True), ("llama4_text", False, False), ("llama", True, False)],
)
def test_packed_batches_a_family_cannot_split_are_refused_before_the_weights_load(
    script, tokenizer, tmp_path, monkeypatch, capsys, model_type, packed, refused
):
    """Llama 4's chunked layers take no packed examples (`can_run_packed`): with --padding_free its split step
    refuses the first batch, after the weights load; the config, read before them, says so. Here one process of a
    two-process launch (no process group: nothing between the checks and the weights needs one)."""
    checkpoint = save_family_checkpoint(tmp_path / model_type, model_type, tokenizer)
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    monkeypatch.setattr(TrainingArguments, "main_process_first", lambda self, **kwargs: contextlib.nullcontext())

    def loaded(*args, **kwargs):
        raise LoadedTheModel

    monkeypatch.setattr(script, "load_model_and_tokenizer", loaded)
    extra = ["--use_cpu", "--do_train", "--max_steps", "1", "--context_parallel_size", "2"]
    argv = script_args(checkpoint, tmp_path / "out", *extra, *(["--padding_free"] if packed else []))
    if not refused:
        with pytest.raises(LoadedTheModel):
            script.main(argv)
        return
    with pytest.raises(SystemExit) as stopped:
        script.main(argv)
    assert stopped.value.code == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        "run_lora_clm.py: error: --padding_free with --context_parallel_size 2: a padding-free packed batch of the "
        "model type 'llama4_text': its chunked layers do not take packed examples. Drop --padding_free: each batch is "
        "then padded, which its split runs exactly."
    )
