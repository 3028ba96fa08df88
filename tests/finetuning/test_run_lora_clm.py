"""Tests of LoRA fine-tuning with the attention flags: examples/language-modeling/run_lora_clm.py and
optimum.habana.cli.finetuning.

Everything runs on a tiny random Llama and a word-level tokenizer trained here on the shipped dataset: no download.
The script's `main(argv, callbacks)` runs in-process so the attention calls can be counted and the gradients read.
"""

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum.habana import GaudiLlamaForCausalLM
from optimum.habana.cli.common import AttentionArguments
from optimum.habana.cli.finetuning import data as finetuning_data
from optimum.habana.cli.finetuning import modeling, prompts
from optimum.habana.cli.finetuning.data import IGNORE_INDEX, FineTuningError
from tests.finetuning.support import DATA_FILE, SCRIPT, TOLERANCE, Run, run_script, script_args
from tests.helpers import FUSED_KERNEL_CPU, load_script, tiny_config


# Three training steps on padded batches of 4, evaluation, and a short generation at the end.
PARITY_ARGS = (
    "--do_train --do_eval --max_steps 3 --per_device_train_batch_size 4 --per_device_eval_batch_size 8 "
    "--logging_steps 1 --learning_rate 1e-2 --lora_dropout 0 --validation_split_percentage 5 "
    "--generation_samples 2 --max_new_tokens 3"
)


@pytest.fixture(scope="module")
def runs(script, checkpoint, tmp_path_factory) -> dict[str, Run]:
    """The same fp32 run, seed and data with the flag off, on, and on with gradient checkpointing."""
    variants = {
        "default": ("--use_flash_attention", "False"),
        "flash": ("--use_flash_attention",),
        "flash_checkpointing": ("--use_flash_attention", "--gradient_checkpointing"),
    }
    return {
        name: run_script(script, script_args(checkpoint, tmp_path_factory.mktemp(name), *PARITY_ARGS.split(), *flags))
        for name, flags in variants.items()
    }


# --- flash attention in training, evaluation and generation -----------------------------------------------------


@pytest.mark.parametrize("variant", ["flash", "flash_checkpointing"])
def test_flash_attention_matches_the_default_path(runs, variant):
    """Same losses and LoRA gradients step by step (the padding carries no label, so it is excluded)."""
    default, flash = runs["default"], runs[variant]
    assert len(flash.losses) == len(default.losses) == 3
    assert flash.losses == pytest.approx(default.losses, abs=TOLERANCE, rel=0)
    assert flash.metrics["eval_loss"] == pytest.approx(default.metrics["eval_loss"], abs=TOLERANCE, rel=0)
    assert len(flash.gradients) == len(default.gradients) == 3
    for flash_step, default_step in zip(flash.gradients, default.gradients, strict=True):
        assert flash_step.keys() == default_step.keys()
        assert all("lora_" in name for name in flash_step)
        for name, gradient in flash_step.items():
            torch.testing.assert_close(gradient, default_step[name], atol=TOLERANCE, rtol=0, msg=name)
    # LoRA B starts at zero, so only its gradients are non-zero on the first step.
    assert any(gradient.abs().max() > 0 for gradient in flash.gradients[0].values())


@pytest.mark.parametrize("variant", ["flash", "flash_checkpointing"])
def test_kernel_runs_every_attention_call_with_the_flag(runs, variant):
    """No call of training, evaluation or generation falls back to the default path."""
    run = runs[variant]
    assert run.metrics["eval_loss"] > 0 and len(run.metrics["generations"]) == 2
    assert run.counts["default"] == 0
    assert run.counts["fused"] > 0
    assert run.counts[FUSED_KERNEL_CPU] > 0


@pytest.mark.parametrize("variant", ["default", "flash"])
def test_padding_free_batches_train_as_padded_ones(script, checkpoint, tmp_path, runs, variant):
    """--padding_free: the same examples, losses and LoRA gradients as padded batches; with the flag every call is
    fused (one per packed example: tests/core/test_packing.py counts them), none on the default path."""
    padded = runs[variant]
    flag = ["--use_flash_attention", "True" if variant == "flash" else "False"]
    packed = run_script(script, script_args(checkpoint, tmp_path, *PARITY_ARGS.split(), *flag, "--padding_free"))
    assert packed.losses == pytest.approx(padded.losses, abs=TOLERANCE, rel=0)
    assert packed.metrics["eval_loss"] == pytest.approx(padded.metrics["eval_loss"], abs=TOLERANCE, rel=0)
    for packed_step, padded_step in zip(packed.gradients, padded.gradients, strict=True):
        for name, gradient in packed_step.items():
            torch.testing.assert_close(gradient, padded_step[name], atol=TOLERANCE, rtol=0, msg=name)
    if variant == "flash":
        assert packed.counts["default"] == 0 and packed.counts["fused"] > 0


def test_default_path_without_the_flag(runs):
    run = runs["default"]
    assert run.counts["default"] > 0
    assert run.counts["fused"] == 0
    assert run.counts[FUSED_KERNEL_CPU] == 0


def test_gradient_checkpointing_forces_recompute(runs):
    """Checkpointed layers run their forward twice: the kernel is asked to keep nothing (defect 4 of the notes)."""
    assert runs["flash_checkpointing"].recompute and all(runs["flash_checkpointing"].recompute)
    assert runs["flash"].recompute and not any(runs["flash"].recompute)


# --- learning and the saved adapter ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(script, checkpoint, tmp_path_factory) -> tuple[Run, Path]:
    """A few dozen steps with the flag on the shipped dataset (the default train file), packed into blocks."""
    output_dir = tmp_path_factory.mktemp("trained")
    training = (
        "--do_train --do_eval --eval_on_start True --use_flash_attention --dataset_concatenation --max_seq_length 64 "
        "--max_steps 30 --per_device_train_batch_size 8 --learning_rate 1e-2 --lr_scheduler_type constant "
        "--logging_steps 10"
    )
    argv = script_args(checkpoint, output_dir, *training.split())
    return run_script(script, argv), output_dir


def test_a_few_dozen_steps_lower_the_eval_loss(trained):
    run, output_dir = trained
    before, after = run.eval_losses[0], run.metrics["eval_loss"]
    assert after < before - 0.1, (before, after)
    assert run.counts["default"] == 0 and run.counts["fused"] > 0
    saved = json.loads((output_dir / "all_results.json").read_text())
    for name in ("train_loss", "eval_loss", "perplexity", "train_samples_per_second", "train_peak_memory_gib"):
        assert saved[name] > 0, name
    assert (output_dir / "adapter_model.safetensors").is_file()
    assert (output_dir / "adapter_config.json").is_file()


def test_saved_adapter_changes_run_generation_output(trained, checkpoint, tmp_path):
    """run_generation.py --peft_model merges the saved adapter: same prompt, same greedy decoding, other text."""
    run_generation = load_script("examples/text-generation/run_generation.py")
    _, adapter_dir = trained
    prompt = prompts.build_prompt("What is the capital of Greece?")
    texts = {}
    for name, extra in {"base": [], "adapted": ["--peft_model", str(adapter_dir)]}.items():
        output_dir = tmp_path / name
        argv = ["--model_name_or_path", str(checkpoint), "--prompt", prompt, "--max_new_tokens", "8"]
        argv += ["--ignore_eos", "--warmup", "0", "--n_iterations", "1", "--output_dir", str(output_dir), *extra]
        assert run_generation.main(argv) == 0
        results = json.loads((output_dir / "results.json").read_text())
        texts[name] = [text["output"] for text in results["texts"]]
    assert texts["base"][0].strip()  # the adapted model may answer with its end-of-sequence token at once
    assert texts["adapted"] != texts["base"]


# --- bad input ---------------------------------------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "does not exist"),
        ("empty", "is empty"),
        ("blank", "has no examples"),
        ("wrong_fields", "none of the expected ones"),
        ("unsupported", "unsupported file type"),
        ("max_seq_length", "--max_seq_length must be at least 1, got 0"),
        ("companion", "`flash_attention_recompute` requires `use_flash_attention`"),
        ("hub_unreachable", "Could not load the dataset 'someone/some-dataset' from the Hugging Face Hub"),
        ("unknown_argument", "--no_such_flag"),
    ],
)
def test_bad_input_is_a_usage_error(script, checkpoint, tmp_path, monkeypatch, capsys, case, message):
    files = {
        "missing": tmp_path / "missing.jsonl",
        "empty": write(tmp_path / "empty.jsonl", ""),
        "blank": write(tmp_path / "blank.txt", "\n \n\n"),
        "wrong_fields": write(tmp_path / "qa.jsonl", '{"question": "Why?", "answer": "Because."}\n'),
        "unsupported": write(tmp_path / "data.parquet", "x"),
    }
    extra = {
        "max_seq_length": ["--max_seq_length", "0"],
        "companion": ["--flash_attention_recompute"],
        "hub_unreachable": ["--dataset_name", "someone/some-dataset"],
        "unknown_argument": ["--no_such_flag", "1"],
    }
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # an unreachable hub, at once
    argv = script_args(checkpoint, tmp_path / "out", "--do_train", *extra.get(case, []))
    if case in files:
        argv += ["--train_file", str(files[case])]
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]  # after the datasets progress bars
    assert last_line.startswith("run_lora_clm.py: error: ") and message in last_line, last_line


def test_usage_error_as_a_script_exits_2_without_traceback(tmp_path):
    command = [
        sys.executable,
        str(SCRIPT),
        "--output_dir",
        str(tmp_path),
        "--do_train",
        "--flash_attention_causal_mask",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "`flash_attention_causal_mask` requires `use_flash_attention`" in result.stderr
    assert "Traceback" not in result.stderr


# --- the library module ------------------------------------------------------------------------------------------


def test_prompt_template():
    assert prompts.build_prompt("Sort.", "b, a") == "### Instruction:\nSort.\n\n### Input:\nb, a\n\n### Response:\n"
    assert prompts.build_prompt("Why?", "") == prompts.build_prompt("Why?", None)
    assert "### Input:" not in prompts.build_prompt("Why?", " ")


def test_instruction_labels_cover_only_the_response(tokenizer):
    dataset = datasets.Dataset.from_list([{"instruction": "What is 2 * 7?", "input": "", "output": "2 * 7 = 14"}])
    (example,) = finetuning_data.tokenize_dataset(dataset, tokenizer, "instruction", max_seq_length=512)
    prompt_length = len(tokenizer(prompts.build_prompt("What is 2 * 7?"))["input_ids"])
    response = tokenizer("2 * 7 = 14", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert example["labels"] == [IGNORE_INDEX] * prompt_length + response
    assert example["input_ids"][prompt_length:] == response
    assert example["attention_mask"] == [1] * len(example["input_ids"])
    # A prompt that fills --max_seq_length leaves nothing to learn: the example is dropped, not trained on.
    assert (
        finetuning_data.tokenize_dataset(dataset, tokenizer, "instruction", max_seq_length=prompt_length).num_rows == 0
    )


def test_plain_text_labels_cover_every_token(tokenizer):
    dataset = datasets.Dataset.from_list([{"text": "flash attention saves memory"}])
    (example,) = finetuning_data.tokenize_dataset(dataset, tokenizer, "text", max_seq_length=3)
    assert example["labels"] == example["input_ids"] and len(example["input_ids"]) == 3


def test_packing_keeps_every_token_and_label(tokenizer):
    raw = datasets.load_dataset("json", data_files=str(DATA_FILE), split="train").select(range(20))
    tokenized = finetuning_data.tokenize_dataset(raw, tokenizer, "instruction", max_seq_length=None)
    packed = finetuning_data.pack_sequences(tokenized, 32)
    assert all(len(ids) == 32 for ids in packed["input_ids"][:-1]) and 0 < len(packed["input_ids"][-1]) <= 32
    for name in ("input_ids", "labels"):
        assert sum(packed[name], []) == sum(tokenized[name], [])


def test_data_files_of_each_format(tmp_path):
    csv = write(tmp_path / "data.csv", "instruction,input,output\nAdd.,1 2,3\nName a color.,,red\n")
    loaded, data_format = finetuning_data.load_raw_datasets(
        train_file=str(csv), validation_file=None, dataset_name=None, validation_split_percentage=0
    )
    assert data_format == "instruction" and loaded["train"].num_rows == 2 and "validation" not in loaded
    txt = write(tmp_path / "notes.txt", "first line\n\nsecond line\nthird line\n")
    loaded, data_format = finetuning_data.load_raw_datasets(
        train_file=str(txt), validation_file=str(txt), dataset_name=None
    )
    assert data_format == "text" and loaded["train"]["text"] == ["first line", "second line", "third line"]
    with pytest.raises(FineTuningError, match="the validation data is instruction data"):
        finetuning_data.load_raw_datasets(train_file=str(txt), validation_file=str(csv), dataset_name=None)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2_moe", "gemma2", "phi3"])
def test_other_families_fine_tune_with_the_same_losses(script, tokenizer, model_type, tmp_path):
    """A sliding-window family, a mixture of experts, a soft-capped one and one with fused q/k/v projections."""
    folder = tmp_path / model_type
    torch.manual_seed(0)
    config = tiny_config(model_type, vocab_size=len(tokenizer), initializer_range=0.1)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    args = "--do_train --max_steps 2 --per_device_train_batch_size 4 --logging_steps 1 --lora_dropout 0"
    args += " --validation_split_percentage 0 --max_seq_length 64"
    default = run_script(script, script_args(folder, tmp_path / "default", *args.split()))
    flash = run_script(script, script_args(folder, tmp_path / "flash", *args.split(), "--use_flash_attention"))
    assert len(flash.losses) == 2
    assert flash.losses == pytest.approx(default.losses, abs=1e-5)
    assert default.counts["fused"] == 0
    if model_type == "gemma2":  # soft-capped logits: every call takes the default path, with one warning
        assert flash.counts["fused"] == 0 and flash.counts["default"] > 0
    else:
        assert flash.counts["fused"] > 0 and flash.counts["default"] == 0
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in flash.gradients[0]}
    expected = {"qkv_proj", "o_proj"} if model_type == "phi3" else {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert adapted == expected


def test_flags_survive_the_peft_wrapper(checkpoint):
    model = GaudiLlamaForCausalLM.from_pretrained(checkpoint)
    flags = modeling.attention_flags_from(
        AttentionArguments(use_flash_attention=True, flash_attention_fast_softmax=True)
    )
    modeling.set_attention_flags(model, flags)
    peft_model = modeling.add_lora(model, modeling.lora_config(rank=4, alpha=8, dropout=0.0))
    assert peft_model.get_base_model().generation_config is model.generation_config
    assert peft_model.generation_config.use_flash_attention is True
    assert peft_model.generation_config.flash_attention_fast_softmax is True
    with pytest.raises(FineTuningError, match="--lora_target_modules"):
        modeling.add_lora(
            GaudiLlamaForCausalLM.from_pretrained(checkpoint),
            modeling.lora_config(rank=4, alpha=8, dropout=0.0, target_modules=["nope"]),
        )


@pytest.mark.parametrize("batches", [[], ["--padding_free"]], ids=["padded", "padding-free packed"])
def test_torch_compile_trains_with_the_flag_without_a_graph_break(script, checkpoint, tmp_path, batches):
    """`--torch_compile` (Trainer compiles the model): the flag's steps trace with no graph break, same losses."""
    from torch._dynamo.utils import counters

    argv = [
        *["--do_train", "--max_steps", "2", "--per_device_train_batch_size", "4", "--logging_steps", "1"],
        *batches,
    ]
    argv += ["--learning_rate", "1e-2", "--lora_dropout", "0", "--use_flash_attention"]
    eager = run_script(script, script_args(checkpoint, tmp_path / "eager", *argv), profile=False)
    torch._dynamo.reset()
    counters.clear()
    compile_argv = [*argv, "--torch_compile", "--torch_compile_backend", "eager"]
    compiled = run_script(script, script_args(checkpoint, tmp_path / "compiled", *compile_argv), profile=False)
    assert counters["stats"]["unique_graphs"] > 0  # it was compiled
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert compiled.losses == pytest.approx(eager.losses, abs=TOLERANCE, rel=0)
    assert compiled.counts["fused"] > 0 and compiled.counts["default"] == 0
