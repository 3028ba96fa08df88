"""Helpers of the run_generation.py tests: a short command line, in-process and subprocess runs, their texts, and
bad inputs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import StableLmConfig

from optimum.habana import GaudiLlamaForCausalLM
from optimum.habana.cli.generation.arguments import ScriptArguments, build_parser, parse_arguments
from optimum.habana.utils.model_loading import CACHE_ENV_VAR
from tests.helpers import ROOT, tiny_config, train_tiny_tokenizer, write_gguf


SCRIPT = ROOT / "examples" / "text-generation" / "run_generation.py"
PROMPTS_OF_THREE_LENGTHS = ["Hello", "The quick brown fox jumps over the lazy dog", "Gaudi is an accelerator"]


def tiny_argv(checkpoint: Path, *extra: str) -> list[str]:
    """Three prompts of different lengths (a padded batch), four new tokens, one measured run."""
    return [
        "--model_name_or_path",
        str(checkpoint),
        "--prompt",
        *PROMPTS_OF_THREE_LENGTHS,
        "--batch_size",
        "3",
        "--max_new_tokens",
        "4",
        "--ignore_eos",
        "--warmup",
        "0",
        "--n_iterations",
        "1",
        *extra,
    ]


def parse(argv: list[str]) -> ScriptArguments:
    return parse_arguments(build_parser(), argv)


def run_in_process(script, argv: list[str], output_dir: Path) -> dict:
    assert script.main([*argv, "--output_dir", str(output_dir)]) == 0
    return json.loads((output_dir / "results.json").read_text())


def outputs(results: dict) -> list[str]:
    return [text["output"] for text in results["texts"]]


def script_env(cache_dir: Path) -> dict[str, str]:
    return {**os.environ, CACHE_ENV_VAR: str(cache_dir), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def start_script(args: list[str], cache_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=script_env(cache_dir),
        cwd=ROOT,
    )


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stdout, stderr


# Bad model, adapter and prompt inputs, each with the words its one-line error must hold: run_generation.py
# refuses them, and so does --explain.


# A family without a Gaudi class (its decoder layers drop the call's keyword arguments), and the words of its refusal.
UNSUPPORTED_FAMILY_REFUSAL = "is a 'stablelm' model, which has no Gaudi class: StableLmDecoderLayer.forward calls"


def save_unsupported_family_config(folder: Path) -> Path:
    StableLmConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32).save_pretrained(
        folder
    )
    return folder


def bad_model_inputs(tiny_checkpoint: Path, folder: Path) -> dict[str, tuple[list[str], str]]:
    no_template = folder / "no_chat_template"
    if not no_template.exists():
        shutil.copytree(tiny_checkpoint, no_template)
        (no_template / "chat_template.jinja").unlink()
    return {
        "gguf of another architecture": (
            ["--model_name_or_path", str(write_gguf(folder / "rwkv.gguf", "rwkv"))],
            "which transformers' GGUF loader does not convert",
        ),
        "family without a Gaudi class": (
            ["--model_name_or_path", str(save_unsupported_family_config(folder / "stablelm"))],
            UNSUPPORTED_FAMILY_REFUSAL,
        ),
        "hub id without a hub": (["--model_name_or_path", "nobody/no-such-model"], "Hugging Face Hub"),
        "folder without config": (["--model_name_or_path", str(folder)], "no config.json"),
        "prompt and new tokens beyond the positions": (
            ["--model_name_or_path", str(tiny_checkpoint), "--max_input_tokens", "100", "--max_new_tokens", "50"],
            "exceeds the model's maximum of 128 positions",
        ),
        "longest prompt beyond the positions": (
            ["--model_name_or_path", str(tiny_checkpoint), "--prompt", "word " * 100, "--max_new_tokens", "50"],
            "the longest prompt",
        ),
        "truncated model weights": (
            ["--model_name_or_path", str(truncated_weights_copy(tiny_checkpoint, folder))],
            "model.safetensors is truncated",
        ),
        "prompt file of NUL bytes": (
            ["--model_name_or_path", str(tiny_checkpoint), "--prompt_file", str(nul_file(folder))],
            "nul.txt' is not text: it holds NUL bytes (the first at character 1). Pass a text file.",
        ),
        "chat without a template": (["--model_name_or_path", str(no_template), "--chat"], "no chat template"),
        "continuous batching of a family the engine refuses": (
            ["--model_name_or_path", str(latent_checkpoint(folder)), "--continuous_batching"],
            "cannot run in transformers' continuous batching: its latent attention keeps keys and values of other "
            "sizes than config.head_dim, which the paged cache holds. Drop --continuous_batching: generate() serves it.",
        ),
        "missing adapter": (
            ["--model_name_or_path", str(tiny_checkpoint), "--peft_model", str(folder / "nothing")],
            "is not a folder",
        ),
        **bad_adapters(tiny_checkpoint, folder),
    }


def latent_checkpoint(folder: Path) -> Path:
    """A tiny DeepSeek-V3 (latent attention: no paged cache holds its keys and values), with a tokenizer."""
    from tests.families.support import save_family_checkpoint

    path = folder / "deepseek_v3"
    if not path.exists():
        save_family_checkpoint(path, "deepseek_v3", train_tiny_tokenizer(chat_template=True))
    return path


def nul_file(folder: Path) -> Path:
    path = folder / "nul.txt"
    path.write_bytes(bytes(4096))
    return path


def truncated_weights_copy(checkpoint: Path, folder: Path) -> Path:
    copy = folder / "truncated_weights"
    if not copy.exists():
        shutil.copytree(checkpoint, copy)
        os.truncate(copy / "model.safetensors", (copy / "model.safetensors").stat().st_size - 100)
    return copy


def bad_adapters(tiny_checkpoint: Path, folder: Path) -> dict[str, tuple[list[str], str]]:
    """A junk config, a folder without weights, and an adapter trained on another base model."""
    cases = {}
    junk, no_weights, other_base = folder / "junk_adapter", folder / "no_weights", folder / "other_base"
    truncated = folder / "truncated_adapter"
    if not junk.exists():
        junk.mkdir()
        (junk / "adapter_config.json").write_text("{not json")
        torch.manual_seed(0)
        wider = GaudiLlamaForCausalLM(tiny_config("llama", hidden_size=96, num_attention_heads=4, vocab_size=300))
        get_peft_model(wider, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(other_base)
        shutil.copytree(other_base, no_weights)
        (no_weights / "adapter_model.safetensors").unlink()
        shutil.copytree(other_base, truncated)
        os.truncate(truncated / "adapter_model.safetensors", 100)
    for name, adapter, message in (
        ("junk adapter config", junk, "adapter_config.json is not valid JSON"),
        ("adapter without weights", no_weights, "but no weights"),
        ("adapter of another base model", other_base, "does not fit this model"),
        ("truncated adapter weights", truncated, "truncated_adapter/adapter_model.safetensors cannot be read"),
    ):
        argv = ["--model_name_or_path", str(tiny_checkpoint), "--max_new_tokens", "4", "--peft_model", str(adapter)]
        cases[name] = (argv, message)
    return cases
