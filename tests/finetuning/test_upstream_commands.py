"""The four flash-attention fine-tuning command lines of Optimum-Habana's language-modeling README, run here.

Each is the README's command with the launcher prefix (`python ../gaudi_spawn.py --world_size 8 ...`) and the
environment variables removed, `--dataset_name tatsu-lab/alpaca` dropped (no hub here: the shipped instruction data),
the model swapped for a tiny Llama, and steps, lengths and batch sizes shrunk. Their DeepSpeed and FSDP options
point at the configs shipped beside run_lora_clm.py, under the same names as upstream's. DeepSpeed is honoured when
installed and otherwise refused with one line; FSDP shards under torchrun and says it has nothing to shard in one
process.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

from optimum.habana.cli.finetuning import sharding as sharded_training
from optimum.habana.utils.distributed import LaunchEnvironment
from tests.finetuning.support import run_script, script_args
from tests.helpers import ROOT, count_attention_paths


EXAMPLES = ROOT / "examples" / "language-modeling"
SCRIPT = EXAMPLES / "run_lora_clm.py"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

# README L359-401, Llama3.1-8B LoRA, ZeRO-1, FP8. Shrunk: epochs, steps, accumulation, length, eval batch.
LLAMA3_8B_ZERO1_FP8 = """--bf16 False --num_train_epochs 1 --max_steps 2 --per_device_train_batch_size 1
    --gradient_accumulation_steps 2 --eval_strategy no --save_strategy no --learning_rate 3e-4 --warmup_ratio 0.03
    --lr_scheduler_type constant --max_grad_norm 1.0 --logging_steps 1 --do_train --do_eval --use_habana
    --use_lazy_mode False --throughput_warmup_steps 1 --lora_rank=8 --lora_alpha=16 --lora_dropout=0.05
    --lora_target_modules q_proj v_proj --dataset_concatenation --max_seq_length 64 --adam_epsilon 1e-08
    --validation_split_percentage 4 --deepspeed llama3_ds_zero1_config.json --torch_compile_backend hpu_backend
    --torch_compile --fp8 --attn_implementation gaudi_fused_sdpa --flash_attention_causal_mask True
    --per_device_eval_batch_size 4 --cache_size_limit 64 --use_regional_compilation --compile_from_sec_iteration
    --allow_unspec_int_on_nn_module True"""
# README L403-441, Llama2-70B LoRA, ZeRO-3, FP8. Shrunk: epochs, steps, length, batch (10 -> 2); --bf16 True
# becomes False: this CPU has no bf16 (transformers refuses it), and the test compares nothing in bf16.
LLAMA2_70B_ZERO3_FP8 = """--deepspeed llama2_ds_zero3_config.json --bf16 False --num_train_epochs 1 --max_steps 2
    --max_seq_len 64 --per_device_train_batch_size 2 --per_device_eval_batch_size 1 --gradient_checkpointing
    --eval_strategy epoch --eval_delay 2 --save_strategy no --learning_rate 0.0018 --warmup_ratio 0.03
    --lr_scheduler_type cosine --logging_steps 1 --dataset_concatenation --attn_softmax_bf16 True --do_train
    --do_eval --use_habana --use_lazy_mode --pipelining_fwd_bwd --throughput_warmup_steps 1 --lora_rank 4
    --lora_target_modules q_proj v_proj k_proj o_proj --validation_split_percentage 4
    --attn_implementation gaudi_fused_sdpa --flash_attention_causal_mask True --fp8 True"""
# README L443-483, Llama2-70B LoRA, FSDP. Shrunk as above; --torch_compile left out (compiling costs a minute here;
# its hpu_backend is tested on its own below).
LLAMA2_70B_FSDP = """--bf16 False --max_seq_len 64 --gradient_checkpointing --per_device_train_batch_size 2
    --save_strategy no --learning_rate 0.0004 --warmup_ratio 0.03 --lr_scheduler_type constant --logging_steps 1
    --dataset_concatenation --do_train --use_habana --throughput_warmup_steps 1 --lora_rank 4
    --lora_target_modules q_proj v_proj k_proj o_proj --attn_softmax_bf16 True --validation_split_percentage 4
    --use_lazy_mode False --fsdp_config fsdp_config.json --fsdp auto_wrap --num_train_epochs 1 --max_steps 2
    --eval_strategy epoch --per_device_eval_batch_size 1 --eval_delay 2 --do_eval --pipelining_fwd_bwd False
    --use_fused_rope False --gradient_accumulation_steps 2 --attn_implementation gaudi_fused_sdpa
    --flash_attention_causal_mask True"""
# README L615-660, Llama3.1-8B LoRA at 32k tokens, DeepSpeed Ulysses over 4 cards. Shrunk: 32768 -> 128 tokens.
LLAMA3_8B_LONG_SEQUENCE = """--bf16 False --max_seq_len 128 --per_device_train_batch_size 1
    --per_device_eval_batch_size 1 --save_strategy no --learning_rate 0.0004 --warmup_ratio 0.03
    --lr_scheduler_type constant --logging_steps 1 --dataset_concatenation --do_train --use_habana
    --throughput_warmup_steps 1 --lora_rank 8 --lora_target_modules q_proj v_proj k_proj o_proj
    --attn_softmax_bf16 True --validation_split_percentage 4 --flash_attention_causal_mask True --eval_strategy epoch
    --pipelining_fwd_bwd --use_lazy_mode --attn_implementation gaudi_fused_sdpa
    --deepspeed llama3_ds_zero1_config.json --num_train_epochs 1 --max_steps 2 --eval_delay 3 --do_eval
    --lora_alpha 16 --lora_dropout 0.05 --gradient_accumulation_steps 1 --flash_attention_recompute True
    --context_parallel_size 4"""
DEEPSPEED_COMMANDS = {
    "llama3-8b-zero1-fp8": LLAMA3_8B_ZERO1_FP8,
    "llama2-70b-zero3-fp8": LLAMA2_70B_ZERO3_FP8,
    "llama3-8b-32k-ulysses": LLAMA3_8B_LONG_SEQUENCE,
}


@pytest.fixture
def in_examples_folder(monkeypatch):
    """Upstream's commands name their configs relative to examples/language-modeling."""
    monkeypatch.chdir(EXAMPLES)


def without_compile(argv: list[str]) -> list[str]:
    return sharded_training.without_options(
        [token for token in argv if token != "--torch_compile"], ("--torch_compile_backend",)
    )


@pytest.mark.skipif(HAS_DEEPSPEED, reason="DeepSpeed is installed: the commands run (next test)")
@pytest.mark.parametrize("name", DEEPSPEED_COMMANDS)
def test_deepspeed_commands_are_refused_in_one_line_without_deepspeed(
    name, script, checkpoint, tmp_path, capsys, in_examples_folder
):
    argv = script_args(checkpoint, tmp_path, *DEEPSPEED_COMMANDS[name].split())
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2
    config = sharded_training.option_value(argv, "--deepspeed")
    assert capsys.readouterr().err == (
        f"run_lora_clm.py: error: --deepspeed {config}: DeepSpeed is not installed here (pip install deepspeed). "
        "Drop --deepspeed to train without it: one process, or data parallel under torchrun --nproc-per-node N.\n"
    )
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize("name", DEEPSPEED_COMMANDS)
def test_deepspeed_commands_train_without_deepspeed_as_the_refusal_says(
    name, script, checkpoint, tmp_path, capsys, in_examples_folder
):
    argv = sharded_training.without_options(DEEPSPEED_COMMANDS[name].split(), ("--deepspeed",))
    if "--context_parallel_size" in argv:  # 4 processes per sequence: one process is refused before anything loads
        with pytest.raises(SystemExit) as stopped:
            script.main(script_args(checkpoint, tmp_path, *without_compile(argv)))
        assert stopped.value.code == 2
        assert (
            "error: --context_parallel_size 4 splits each sequence over 4 processes, and this is one process: launch "
            "4 (or a multiple, for data-parallel replicas), e.g. torchrun --nproc-per-node 4."
        ) in capsys.readouterr().err
        return
    result = run_script(script, script_args(checkpoint, tmp_path, *without_compile(argv)))
    assert result.counts["fused"] > 0 and result.counts["default"] == 0
    assert result.metrics["train_loss"] > 0 and result.metrics["eval_loss"] > 0
    assert (tmp_path / "adapter_model.safetensors").is_file()


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (pip install deepspeed)")
def test_a_deepspeed_command_runs_in_one_process_with_deepspeed(
    script, checkpoint, tmp_path, caplog, monkeypatch, in_examples_folder
):
    argv = script_args(checkpoint, tmp_path, *without_compile(LLAMA3_8B_ZERO1_FP8.split()), "--use_cpu")
    # TrainingArguments and accelerate mark this process as DeepSpeed's (ACCELERATE_USE_DEEPSPEED, the shared
    # accelerator state): undone after the run, or every later Trainer of this process (and the launchers it starts,
    # which inherit the environment) would take DeepSpeed beside --fsdp.
    environment = dict(os.environ)
    try:
        with count_attention_paths(monkeypatch) as counts:  # DeepSpeed keeps the gradients: run_script cannot see them
            metrics = script.main(argv)
    finally:
        os.environ.clear()
        os.environ.update(environment)
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    assert counts["fused"] > 0 and counts["default"] == 0 and metrics["train_loss"] > 0
    assert "DeepSpeed's engine runs on a one-process group" in caplog.text


def test_fsdp_command_in_one_process_says_it_shards_nothing(script, checkpoint, tmp_path, caplog, in_examples_folder):
    result = run_script(script, script_args(checkpoint, tmp_path, *LLAMA2_70B_FSDP.split()))
    assert result.counts["fused"] > 0 and result.counts["default"] == 0
    assert result.metrics["train_loss"] > 0 and result.metrics["eval_loss"] > 0
    assert "--fsdp auto_wrap: one process here, so there is nothing to shard: training runs unsharded." in caplog.text


def test_fsdp_command_under_torchrun_shards_with_upstreams_class_name(checkpoint, tmp_path):
    """Two processes: FSDP through accelerate, with upstream's `GaudiLlamaDecoderLayer` read as transformers'."""
    (tmp_path / "fsdp_config.json").write_text(
        (EXAMPLES / "fsdp_config.json").read_text().replace('"LlamaDecoderLayer"', '"GaudiLlamaDecoderLayer"')
    )
    argv = LLAMA2_70B_FSDP.split()
    argv = [str(tmp_path / "fsdp_config.json") if token == "fsdp_config.json" else token for token in argv]
    output = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
    command += script_args(checkpoint, output, *argv, "--use_cpu", "--use_flash_attention")
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes (FSDP)" in done.stdout
    assert (
        "transformer_layer_cls_to_wrap GaudiLlamaDecoderLayer: the decoder layers here are transformers' "
        "LlamaDecoderLayer; wrapping those." in done.stderr
    )
    assert (output / "adapter_model.safetensors").is_file()


def test_sharding_options_are_checked_before_anything_loads(tmp_path):
    one = LaunchEnvironment()
    with pytest.raises(ValueError, match="--fsdp_config 'nope.json' is not a file"):
        sharded_training.prepare_sharding_arguments(["--fsdp", "auto_wrap", "--fsdp_config", "nope.json"], one)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="--fsdp_config .*broken.json' is not valid JSON"):
        sharded_training.prepare_sharding_arguments(["--fsdp_config", str(broken)], one)
    argv, notes = sharded_training.prepare_sharding_arguments(
        ["--do_train", "--fsdp=auto_wrap", "--fsdp_config", str(EXAMPLES / "fsdp_config.json"), "--seed", "1"], one
    )
    assert argv == ["--do_train", "--seed", "1"] and len(notes) == 1
    two = LaunchEnvironment(rank=0, local_rank=0, world_size=2, local_world_size=2)
    kept = ["--fsdp", "auto_wrap", "--fsdp_config", str(EXAMPLES / "fsdp_config.json")]
    assert sharded_training.prepare_sharding_arguments(kept, two) == (kept, [])


def test_hpu_compile_backend_compiles_with_inductor_elsewhere(script, checkpoint, tmp_path, caplog):
    from transformers import TrainingArguments

    from optimum.habana.cli.finetuning.gaudi_arguments import GaudiTrainingArguments, apply_gaudi_training_arguments

    arguments = TrainingArguments(output_dir=str(tmp_path), torch_compile_backend="hpu_backend", use_cpu=True)
    notes = apply_gaudi_training_arguments(GaudiTrainingArguments(), arguments, arguments.device, None)
    assert arguments.torch_compile and arguments.torch_compile_backend == "inductor"
    assert notes == [
        "--torch_compile_backend hpu_backend: Gaudi's compiler; no Gaudi here, so torch.compile uses inductor on cpu."
    ]
