"""Optimum-Habana's model and data loading options of run_lora_clm.py: each acts, or prints one line."""

import json

import pytest
import torch
from transformers import AutoConfig, Qwen2Config, TrainerCallback, TrainingArguments

from optimum.habana.cli.finetuning import data as finetuning_data
from optimum.habana.cli.finetuning import loading_options, prompts
from optimum.habana.cli.finetuning.arguments import DataArguments, ModelArguments
from optimum.habana.cli.finetuning.data import column_renames
from optimum.habana.cli.finetuning.gaudi_arguments import GaudiTrainingArguments, apply_gaudi_training_arguments
from optimum.habana.utils.model_loading import resolve_model
from tests.finetuning.support import run_script, script_args


STEPS = "--do_train --max_steps 2 --per_device_train_batch_size 2 --logging_steps 1 --validation_split_percentage 0"


def test_options_that_do_not_act_here_say_so(script, checkpoint, tmp_path, caplog):
    argv = ["--model_revision", "v2", "--use_auth_token", "--use_fast_tokenizer", "False", "--trust_remote_code"]
    argv += ["--load_meta_device", "--flash_attention_fp8", "--dataset_cache_directory", "cache"]
    run_script(script, script_args(checkpoint, tmp_path, *STEPS.split(), *argv))
    for line in (
        "--model_revision v2: ",
        "is not a hub repo, so it has no revisions; it is loaded as it is.",
        "--use_auth_token: deprecated upstream; the hub login, HF_TOKEN or --token is used as it is.",
        "--use_fast_tokenizer False: transformers 5 has one tokenizer class per model; it is used.",
        "--trust_remote_code: the supported families are transformers' own classes",
        "--load_meta_device: transformers 5 always builds the model on the meta device",
        "--flash_attention_fp8: fp8 attention is not supported by this library",
        "--dataset_cache_directory cache: datasets caches the processed data in its own cache",
    ):
        assert line in caplog.text


def test_config_name_loads_that_config(script, checkpoint, tmp_path):
    other = tmp_path / "config"
    config = AutoConfig.from_pretrained(checkpoint)
    config.rms_norm_eps = 0.25  # visible in every forward
    config.save_pretrained(other)
    seen = []

    class SeeConfig(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen.append(model.get_base_model().config.rms_norm_eps)

    argv = script_args(checkpoint, tmp_path / "out", *STEPS.split(), "--config_name", str(other))
    script.main(argv, callbacks=[SeeConfig()])
    assert seen == [0.25]


def test_config_of_another_family_and_missing_names_are_usage_errors(script, checkpoint, tmp_path, capsys):
    qwen = tmp_path / "qwen"
    Qwen2Config().save_pretrained(qwen)
    for argv, words in (
        (["--config_name", str(qwen)], "--config_name is a qwen2 config but the model is a llama"),
        (["--config_name", str(tmp_path / "none")], f"--config_name {str(tmp_path / 'none')!r} holds no usable"),
        (["--tokenizer_name", str(tmp_path / "none")], f"--tokenizer_name {str(tmp_path / 'none')!r} holds no"),
        (["--chat_prompt", "--sql_prompt"], "--chat_prompt and --sql_prompt choose two prompts: pass one."),
    ):
        with pytest.raises(SystemExit) as exit_info:
            script.main(script_args(checkpoint, tmp_path / "out", *STEPS.split(), *argv))
        assert exit_info.value.code == 2
        assert words in capsys.readouterr().err


def test_tokenizer_name_loads_that_tokenizer(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = loading_options.load_tokenizer_override(str(tmp_path / "tok"), None)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loading_options.load_tokenizer_override(None, None) is None


def test_hub_options_reach_the_download(monkeypatch, tmp_path):
    calls = []

    def download(repo_id, **kwargs):
        calls.append(kwargs)
        (tmp_path / "config.json").write_text("{}")
        return str(tmp_path)

    monkeypatch.setattr("optimum.habana.utils.model_loading.snapshot_download", download)
    arguments = ModelArguments(model_revision="refs/pr/1", cache_dir="/cache", token="hf_x")
    resolve_model("someone/some-model", **loading_options.hub_options(arguments))
    assert calls[0]["revision"] == "refs/pr/1" and calls[0]["cache_dir"] == "/cache" and calls[0]["token"] == "hf_x"
    assert loading_options.hub_options(ModelArguments())["revision"] is None


def test_sql_prompt_reads_question_context_answer(script, checkpoint, tmp_path, tokenizer):
    data = tmp_path / "sql.jsonl"
    rows = [
        {"question": f"How many heads in team {i}?", "context": "CREATE TABLE head (age INTEGER)", "answer": "SELECT"}
        for i in range(6)
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    arguments = DataArguments(sql_prompt=True)
    loading_options.apply_sql_columns(arguments)
    assert column_renames(arguments) == {"question": "instruction", "context": "input", "answer": "output"}
    raw, data_format = finetuning_data.load_raw_datasets(
        train_file=str(data),
        validation_file=None,
        dataset_name=None,
        validation_split_percentage=0,
        columns=column_renames(arguments),
    )
    tokenized = finetuning_data.tokenize_dataset(raw["train"], tokenizer, data_format, 256, prompt_style="sql")
    prompt = prompts.build_sql_prompt(rows[0]["question"], rows[0]["context"])
    assert "### Question:\nHow many heads in team 0?" in prompt and prompt.endswith("### SQL:\n")
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert tokenized[0]["input_ids"][: len(prompt_ids)] == prompt_ids
    metrics = script.main(
        script_args(checkpoint, tmp_path / "out", *STEPS.split(), "--train_file", str(data), "--sql_prompt")
    )
    assert metrics["train_loss"] > 0


def test_dataset_seed_chooses_the_validation_split(script):
    def validation(seed):
        raw, _ = finetuning_data.load_raw_datasets(
            train_file=str(script.DEFAULT_TRAIN_FILE),
            validation_file=None,
            dataset_name=None,
            validation_split_percentage=20,
            seed=seed,
        )
        return raw["validation"]["instruction"]

    assert validation(1) == validation(1) != validation(2)


def test_keep_in_memory_loads_the_data_into_memory(script):
    mapped = finetuning_data.load_data_file(str(script.DEFAULT_TRAIN_FILE), "--train_file")
    in_memory = finetuning_data.load_data_file(
        str(script.DEFAULT_TRAIN_FILE), "--train_file", load_options={"keep_in_memory": True}
    )
    assert mapped.cache_files and not in_memory.cache_files
    assert mapped["instruction"] == in_memory["instruction"]


def test_overwrite_cache_tokenizes_again(script, tokenizer):
    raw, data_format = finetuning_data.load_raw_datasets(
        train_file=str(script.DEFAULT_TRAIN_FILE),
        validation_file=None,
        dataset_name=None,
        validation_split_percentage=0,
    )
    calls = []
    original = tokenizer.__class__.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tokenizer.__class__, "__call__", counted)
        finetuning_data.tokenize_dataset(raw["train"], tokenizer, data_format, 64)
        cached = len(calls)
        finetuning_data.tokenize_dataset(raw["train"], tokenizer, data_format, 64)
        assert len(calls) == cached  # datasets' cache answered
        finetuning_data.tokenize_dataset(raw["train"], tokenizer, data_format, 64, load_from_cache_file=False)
        assert len(calls) > cached


def test_sdp_on_bf16_sets_pytorchs_math_sdpa_switch(tmp_path):
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    try:
        training_args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True)
        notes = apply_gaudi_training_arguments(
            GaudiTrainingArguments(sdp_on_bf16=True), training_args, training_args.device, torch.bfloat16
        )
        assert torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed() and notes == []
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(before)
