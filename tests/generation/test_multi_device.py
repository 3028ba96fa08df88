"""Multi-process runs on the CPU (gloo, 2 processes): tensor-parallel generation and data-parallel LoRA fine-tuning.

Every end-to-end test starts `torchrun --standalone` (a free port, so concurrent runs do not collide) with one
torch thread per rank. The model-level checks of every family run in one launch (tests/generation/tensor_parallel_worker.py).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum.habana.cli.finetuning.sharding import data_parallel_launch_problem
from optimum.habana.cli.generation.multi_process import ParallelArguments, validate_parallel_arguments
from optimum.habana.transformers.models import GAUDI_CAUSAL_LM_CLASSES
from optimum.habana.utils.distributed import (
    LaunchEnvironment,
    check_device_count,
    check_heads_divisible,
    check_tensor_parallel_plan,
    launch_environment,
)
from optimum.habana.utils.model_loading import CACHE_ENV_VAR
from tests.generation.support import PROMPTS_OF_THREE_LENGTHS
from tests.helpers import FAMILIES, ROOT, load_script, once_per_session, save_tiny_checkpoint, tiny_config, write_gguf


RUN_GENERATION = ROOT / "examples" / "text-generation" / "run_generation.py"
RUN_LORA_CLM = ROOT / "examples" / "language-modeling" / "run_lora_clm.py"
TWO_PROCESSES = ["--standalone", "--nproc-per-node", "2"]
TIMEOUT_S = 300


def environment(cache_dir: Path) -> dict[str, str]:
    return {**os.environ, CACHE_ENV_VAR: str(cache_dir), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def torchrun(arguments: list[str], cache_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", *TWO_PROCESSES, *arguments]
    return subprocess.run(
        command, capture_output=True, text=True, env=environment(cache_dir), cwd=ROOT, timeout=TIMEOUT_S
    )


# ---------------------------------------------------------------------------------------------------------------
# Every family, tensor-parallel against whole, in one launch


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory, cache_dir) -> list[dict]:
    """Tiny checkpoints of every supported family (4 query / 2 key-value heads), compared in 2 processes."""

    def produce(folder: Path) -> list[dict]:
        for model_type in FAMILIES:
            torch.manual_seed(0)
            checkpoint = folder / "families" / model_type
            AutoModelForCausalLM.from_config(tiny_config(model_type)).save_pretrained(checkpoint)
        (folder / "gguf").mkdir()
        write_gguf(folder / "gguf" / "model.gguf", "llama")
        write_gguf(folder / "gguf" / "other.gguf", "rwkv")
        arguments = [
            "-m",
            "tests.generation.tensor_parallel_worker",
            *(str(folder / name) for name in ("families", "gguf", ".")),
        ]
        result = torchrun(arguments, cache_dir)
        assert result.returncode == 0, result.stderr[-5000:]
        return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]

    return once_per_session(tmp_path_factory, "tensor_parallel_worker", produce)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_tensor_parallel_generation_matches_one_process(worker_results, model_type):
    """Batch 1 and a left-padded batch, with and without the flag: the same greedy tokens on every rank."""
    for rank in worker_results:
        family = rank["families"][model_type]
        for case in ("batch1-default", "padded-default", "batch1-flash", "padded-flash"):
            assert family[case]["same_tokens"], case


@pytest.mark.parametrize("model_type", FAMILIES)
def test_flag_runs_the_fused_kernel_on_the_local_heads(worker_results, model_type):
    """Each rank's attention sees its 2 of the 4 query heads; the flag decides the path there as in one process.

    Where the family's plan gathers the query projection's output (Olmo2, Phi3's fused qkv), every rank attends
    over all 4 heads and only the MLP and output projection are split.
    """
    family = worker_results[0]["families"][model_type]
    plan = GAUDI_CAUSAL_LM_CLASSES[model_type].config_class.base_model_tp_plan
    query_style = plan.get("layers.*.self_attn.q_proj") or plan["layers.*.self_attn.qkv_proj"]
    assert family["batch1-flash"]["heads"] == [2 if query_style == "colwise" else 4]
    assert family["padded-default"]["paths"] == ["default"]
    if model_type == "gemma2":  # soft-capped logits: no fused kernel computes them, in one process or several
        assert family["batch1-flash"]["paths"] == ["default"]
    else:
        assert family["batch1-flash"]["paths"] == ["fused"]
        assert family["padded-flash"]["paths"] == ["fused"]


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "phi3"])
def test_each_rank_holds_about_half_of_the_weights(worker_results, model_type):
    """Norms stay whole on every rank; everything else is split in two."""
    for rank in worker_results:
        family = rank["families"][model_type]
        assert 0.45 < family["rank_model_size_bytes"] / family["model_size_bytes"] < 0.6


def test_gguf_is_converted_once_then_loaded_by_every_rank(worker_results):
    """The first rank of the machine converts while the other waits; both then load the same cached folder."""
    assert [rank["gguf"]["conversions_by_rank"] for rank in worker_results] == [["0"], ["0"]]
    assert len({rank["gguf"]["path"] for rank in worker_results}) == 1
    assert [rank["gguf"]["converted_now"] for rank in worker_results] == [False, False]  # found in the cache


def test_a_bad_gguf_stops_every_rank_with_the_same_message(worker_results):
    errors = [rank["gguf"]["error"] for rank in worker_results]
    assert errors[0] is not None and "'rwkv', which transformers' GGUF loader does not convert" in errors[0]
    assert errors[1] == errors[0]


# ---------------------------------------------------------------------------------------------------------------
# run_generation.py under torchrun


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


# One launch (torchrun costs seconds of imports per process): the script's plumbing under TP with a padded batch and
# the flag; the default path and batch 1 under TP are the worker's cases above, for every family.
GENERATION_WORKLOADS = {
    "padded-flash": ["--prompt", *PROMPTS_OF_THREE_LENGTHS, "--batch_size", "3", "--use_flash_attention"],
}


@pytest.fixture(scope="module")
def generation_runs(tiny_checkpoint, cache_dir, tmp_path_factory, _one_torch_thread) -> dict[str, dict]:
    """Each workload in one process (in this process) and in two (torchrun); their results.json files."""

    def produce(folder: Path) -> dict[str, dict]:
        script = load_script("examples/text-generation/run_generation.py")
        runs = {}
        for name, workload in GENERATION_WORKLOADS.items():
            args = [
                "--model_name_or_path",
                str(tiny_checkpoint),
                "--max_new_tokens",
                "8",
                "--n_iterations",
                "1",
                "--warmup",
                "0",
            ]
            args += workload
            one, two = folder / f"{name}-one", folder / f"{name}-two"
            assert script.main([*args, "--output_dir", str(one)]) == 0
            result = torchrun([str(RUN_GENERATION), *args, "--output_dir", str(two)], cache_dir)
            assert result.returncode == 0, result.stderr[-5000:]
            runs[name] = {
                "one": json.loads((one / "results.json").read_text()),
                "two": json.loads((two / "results.json").read_text()),
                "stdout": result.stdout,
            }
        return runs

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV_VAR, str(cache_dir))
        return once_per_session(tmp_path_factory, "generation_runs", produce)


@pytest.mark.parametrize("workload", GENERATION_WORKLOADS)
def test_script_under_torchrun_generates_the_single_process_texts(generation_runs, workload):
    one, two = generation_runs[workload]["one"], generation_runs[workload]["two"]
    assert [text["output"] for text in two["texts"]] == [text["output"] for text in one["texts"]]
    assert two["stats"]["new_tokens"] == one["stats"]["new_tokens"] == 8


def test_script_reports_every_rank_and_the_world_size(generation_runs):
    one, two = generation_runs["padded-flash"]["one"], generation_runs["padded-flash"]["two"]
    assert one["stats"]["world_size"] == 1 and one["stats"]["parallel_strategy"] == "none"
    assert two["stats"]["world_size"] == 2 and two["stats"]["parallel_strategy"] == "tp"
    assert two["stats"]["backend"] == "gloo"
    ranks = two["stats"]["per_rank"]
    assert [rank["rank"] for rank in ranks] == [0, 1]
    for rank in ranks:
        assert rank["memory_allocated_bytes"] > 0
        assert 0.45 < rank["model_size_bytes"] / one["stats"]["model_size_bytes"] < 0.6
    assert two["arguments"]["parallel_strategy"] == "auto"


def test_only_rank_zero_prints(generation_runs):
    stdout = generation_runs["padded-flash"]["stdout"]
    assert stdout.count("Stats:") == 1
    assert stdout.count("--- [1/3] ---") == 1
    assert "Processes: 2, tensor parallel" in stdout
    assert "rank 1 (cpu)" in stdout


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is optional: pip install deepspeed"
)
def test_deepspeed_autotp_on_cpu_generates_the_single_process_texts(
    generation_runs, tiny_checkpoint, cache_dir, tmp_path
):
    """--use_deepspeed on gloo: DeepSpeed's shared-memory all-reduce is switched off, the gloo group all-reduces."""
    args = [
        "--model_name_or_path",
        str(tiny_checkpoint),
        "--max_new_tokens",
        "8",
        "--n_iterations",
        "1",
        "--warmup",
        "0",
    ]
    args += [*GENERATION_WORKLOADS["padded-flash"], "--use_deepspeed", "--output_dir", str(tmp_path)]
    result = torchrun([str(RUN_GENERATION), *args], cache_dir)
    assert result.returncode == 0, result.stderr[-5000:]
    two = json.loads((tmp_path / "results.json").read_text())
    one = generation_runs["padded-flash"]["one"]
    assert [text["output"] for text in two["texts"]] == [text["output"] for text in one["texts"]]
    assert two["stats"]["parallel_strategy"] == "deepspeed"


def test_tp_in_one_process_says_there_is_nothing_to_shard(tiny_checkpoint, tmp_path, capsys, _one_torch_thread):
    script = load_script("examples/text-generation/run_generation.py")
    args = [
        "--model_name_or_path",
        str(tiny_checkpoint),
        "--max_new_tokens",
        "2",
        "--warmup",
        "0",
        "--n_iterations",
        "1",
    ]
    assert script.main([*args, "--parallel_strategy", "tp", "--output_dir", str(tmp_path)]) == 0
    assert "--parallel_strategy tp with one process: nothing to shard" in capsys.readouterr().err
    assert json.loads((tmp_path / "results.json").read_text())["stats"]["parallel_strategy"] == "none"


def test_heads_not_divisible_is_one_clear_error(tmp_path, cache_dir):
    """3 query heads over 2 processes: stopped before loading, one message (rank 0's), no traceback of ours."""
    folder = tmp_path / "three_heads"
    tokenizer_folder = save_tiny_checkpoint(tmp_path / "tokenizer_source")
    config = tiny_config("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=3, vocab_size=300)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_folder / name).read_bytes())
    result = torchrun([str(RUN_GENERATION), "--model_name_or_path", str(folder), "--max_new_tokens", "2"], cache_dir)
    assert result.returncode != 0
    message = "the model's num_attention_heads (3) must be divisible by the number of processes"
    assert result.stderr.count(message) == 1
    assert 'run_generation.py", line' not in result.stderr
    assert result.stdout == ""


# ---------------------------------------------------------------------------------------------------------------
# Checks without processes


def launch(world_size: int) -> LaunchEnvironment:
    return LaunchEnvironment(rank=0, local_rank=0, world_size=world_size, local_world_size=world_size)


def test_launch_environment_reads_torchrun_variables():
    environ = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert launch_environment(environ) == LaunchEnvironment(rank=3, local_rank=1, world_size=4, local_world_size=2)
    assert not launch_environment({}).is_distributed


def test_more_processes_than_devices_is_an_error():
    with pytest.raises(ValueError, match=r"4 processes .* 2 cuda device\(s\).*--nproc-per-node 2 or fewer"):
        check_device_count("cuda", 4, 2)
    check_device_count("hpu", 8, 8)
    check_device_count("cpu", 4, None)  # processes share the cores


def test_every_supported_family_has_a_tensor_parallel_plan():
    for model_type, model_class in GAUDI_CAUSAL_LM_CLASSES.items():
        check_tensor_parallel_plan(model_class, tiny_config(model_type), 2)


def test_a_family_without_a_plan_is_named():
    config = tiny_config("mistral")
    config.base_model_tp_plan = None
    with pytest.raises(ValueError, match=r"model type 'mistral' \(GaudiMistralForCausalLM\) has no tensor-parallel"):
        check_tensor_parallel_plan(GAUDI_CAUSAL_LM_CLASSES["mistral"], config, 2)


def test_key_value_heads_must_divide_too():
    check_heads_divisible(tiny_config("llama"), 2)  # 4 query, 2 key/value heads
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) must be divisible"):
        check_heads_divisible(tiny_config("llama"), 4)


@pytest.mark.parametrize(
    ("arguments", "world_size", "message"),
    [
        (ParallelArguments(parallel_strategy="none"), 2, "--parallel_strategy none runs the whole model in each"),
        (ParallelArguments(use_deepspeed=True, parallel_strategy="none"), 1, "drop --parallel_strategy none"),
    ],
)
def test_contradicting_parallel_arguments_are_errors(arguments, world_size, message):
    with pytest.raises(ValueError, match=message):
        validate_parallel_arguments(arguments, launch(world_size))


def test_deepspeed_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="--use_deepspeed: DeepSpeed is not installed. `pip install deepspeed`"):
        validate_parallel_arguments(ParallelArguments(use_deepspeed=True), launch(2))


# ---------------------------------------------------------------------------------------------------------------
# run_lora_clm.py under torchrun: data parallel through the Trainer


def first_step_loss(output_dir: Path) -> float:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return next(entry["loss"] for entry in history if entry.get("step") == 1 and "loss" in entry)


def test_two_process_lora_matches_one_process_with_the_same_global_batch(tiny_checkpoint, cache_dir, tmp_path):
    """Global batch 4: one process with 4 rows, or two with 2 each; the flag on in both.

    The Trainer averages the loss over the tokens of all processes (average_tokens_across_devices), so the
    two-process loss is that of the whole global batch, as in one process.
    """
    common = (
        f"--model_name_or_path {tiny_checkpoint} --report_to none --save_strategy no --disable_tqdm True "
        "--dataloader_pin_memory False --seed 0 --do_train --max_steps 1 --logging_steps 1 --learning_rate 1e-2 "
        "--lora_dropout 0 --max_seq_length 64 --use_flash_attention --use_cpu"
    ).split()
    one, two = tmp_path / "one", tmp_path / "two"
    load_script("examples/language-modeling/run_lora_clm.py").main(
        [*common, "--output_dir", str(one), "--per_device_train_batch_size", "4"]
    )
    result = torchrun(
        [str(RUN_LORA_CLM), *common, "--output_dir", str(two), "--per_device_train_batch_size", "2"], cache_dir
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert "2 processes (data parallel)" in result.stdout
    assert abs(first_step_loss(two) - first_step_loss(one)) < 1e-4
    metrics = json.loads((two / "train_results.json").read_text())
    assert metrics["train_samples_per_second"] > 0
    assert metrics["epoch"] == json.loads((one / "train_results.json").read_text())["epoch"]  # same samples seen


def test_cpu_data_parallel_needs_use_cpu(monkeypatch):
    """Without --use_cpu accelerate would leave each CPU process training alone on the same data."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
    assert "add --use_cpu" in data_parallel_launch_problem(False, launch(2))
    assert data_parallel_launch_problem(True, launch(2)) is None
    assert data_parallel_launch_problem(False, launch(1)) is None
