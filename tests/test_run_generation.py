"""Tests of examples/text-generation/run_generation.py and its helpers in optimum.habana.example_support.text_generation.

End-to-end runs use a tiny random Llama saved with a tokenizer trained here (no download); the embedded
SmolLM2-135M-Instruct is converted once for the module, into the module's own cache, for a real answer.
Torch runs on one thread here, and so do the scripts started here: two processes with two threads each on a
2-core machine (pytest -n 2) slow each other down many times over.
"""

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, BatchEncoding, GPT2Config, PreTrainedTokenizerFast

from optimum.habana import GaudiLlamaForCausalLM, supported_model_types
from optimum.habana.example_support import text_generation
from optimum.habana.example_support.text_generation import (
    DEFAULT_PROMPTS,
    RunMeasurement,
    benchmark,
    build_generation_config,
    build_parser,
    check_sequence_length,
    parse_arguments,
    prompt_pool,
    prompts_for_batch,
    summarize_runs,
    tokenize_prompts,
)
from optimum.habana.transformers import attention
from optimum.habana.utils.model_loading import CACHE_ENV_VAR

from .utils import FLASH_KERNEL_CPU, count_attention_paths, embedded_model, tiny_config


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "text-generation" / "run_generation.py"
TOKENIZER_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Flash attention computes exact attention without the full score matrix.",
    "Gaudi is an accelerator for deep learning training and inference.",
    "Once upon a time there was a tiny language model.",
]
PROMPTS_OF_THREE_LENGTHS = ["Hello", "The quick brown fox jumps over the lazy dog", "Gaudi is an accelerator"]
STATS_FIELDS = {
    "throughput_tokens_per_second",
    "first_token_latency_seconds",
    "generation_seconds",
    "batch_size",
    "input_tokens",
    "new_tokens",
    "runs",
    "memory_allocated_bytes",
    "max_memory_allocated_bytes",
    "model_size_bytes",
    "num_parameters",
    "model_load_seconds",
    "gguf_converted",
    "warmup_seconds",
    "compile_seconds",
}


# ---------------------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("optimum_habana_cache")


@pytest.fixture(autouse=True)
def _use_module_cache(monkeypatch, cache_dir):
    """Keep every test away from the user's cache, and from the hub."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(cache_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def script():
    """The example script as a module, for calling main(argv) in this process."""
    spec = importlib.util.spec_from_file_location("run_generation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_tiny_tokenizer(chat_template: bool) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few sentences: any text tokenizes, nothing is downloaded."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],  # ids 0, 1, 2: tiny_llama_config's pad, bos and eos
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TOKENIZER_SENTENCES, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    if chat_template:
        fast.chat_template = (
            "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}"
        )
    return fast


def save_tiny_checkpoint(folder: Path, chat_template: bool = True, model_type: str = "llama") -> Path:
    """A stock checkpoint of `model_type`, as a user would pass it, with a tokenizer beside it."""
    tokenizer = train_tiny_tokenizer(chat_template)
    torch.manual_seed(0)
    config = tiny_config(model_type, vocab_size=len(tokenizer), max_position_embeddings=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    """The embedded SmolLM2's cache folder and resolution, converted once per session (tests/utils.py)."""
    return embedded_model(tmp_path_factory)


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


def run_in_process(script, argv: list[str], output_dir: Path) -> dict:
    assert script.main([*argv, "--output_dir", str(output_dir)]) == 0
    return json.loads((output_dir / "results.json").read_text())


def outputs(results: dict) -> list[str]:
    return [text["output"] for text in results["texts"]]


# ---------------------------------------------------------------------------------------------------------------
# End to end, in subprocesses, on the tiny checkpoint


def test_end_to_end_same_greedy_texts_with_and_without_flash_attention(tiny_checkpoint, cache_dir, tmp_path):
    """Batch 1, and batch 3 with prompts of different lengths padded to --max_input_tokens; four runs at once."""
    common = ["--model_name_or_path", str(tiny_checkpoint), "--max_new_tokens", "8", "--n_iterations", "2"]
    workloads = {
        "batch1": ["--prompt", "Gaudi is an accelerator"],
        "batch3": ["--prompt", *PROMPTS_OF_THREE_LENGTHS, "--batch_size", "3", "--max_input_tokens", "20"],
    }
    processes = {}
    for name, workload in workloads.items():
        for flash in (False, True):
            output_dir = tmp_path / f"{name}-{flash}"
            args = [*common, *workload, "--output_dir", str(output_dir)]
            processes[name, flash] = start_script([*args, "--use_flash_attention"] if flash else args, cache_dir)
    results = {}
    for key, process in processes.items():
        returncode, stdout, stderr = finish(process)
        assert returncode == 0, stderr
        assert "Traceback" not in stderr
        assert "Output:" in stdout and "Throughput" in stdout and "Average first token latency" in stdout
        results[key] = json.loads((tmp_path / f"{key[0]}-{key[1]}" / "results.json").read_text())

    for name in workloads:
        default, flash = results[name, False], results[name, True]
        assert outputs(default) == outputs(flash)
        assert all(outputs(flash))
        assert default["arguments"]["use_flash_attention"] is False
        assert flash["arguments"]["use_flash_attention"] is True
        assert flash["generation_config"]["use_flash_attention"] is True

    batch3 = results["batch3", True]
    assert [text["prompt"] for text in batch3["texts"]] == PROMPTS_OF_THREE_LENGTHS
    assert batch3["stats"]["input_tokens"] == 20
    real_lengths = [text["input_tokens"] for text in batch3["texts"]]
    assert len(set(real_lengths)) == 3 and max(real_lengths) == 20  # different lengths, the longest truncated

    report = results["batch1", True]
    assert {"arguments", "versions", "device", "dtype", "model", "generation_config", "texts", "stats"} <= set(report)
    assert set(report["versions"]) == {"optimum-gaudi-flash", "transformers", "torch", "python"}
    assert report["versions"]["torch"] == torch.__version__
    assert set(report["stats"]) >= STATS_FIELDS
    stats = report["stats"]
    assert len(stats["runs"]) == 2  # the warm-up run is excluded
    assert stats["throughput_tokens_per_second"] > 0 and stats["first_token_latency_seconds"] > 0
    assert stats["first_token_latency_seconds"] < stats["generation_seconds"]
    assert stats["max_memory_allocated_bytes"] >= stats["model_size_bytes"] > 0
    assert stats["compile_seconds"] is None
    assert report["device"] == "cpu" and report["dtype"] == "float32"


# ---------------------------------------------------------------------------------------------------------------
# The flags reach the kernel


def tiny_argv(checkpoint: Path, *extra: str) -> list[str]:
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


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_supported_family_runs_with_the_same_texts(script, model_type, tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / model_type, model_type=model_type)
    argv = ["--model_name_or_path", str(checkpoint), "--batch_size", "2", "--max_new_tokens", "4"]
    argv += ["--warmup", "0", "--n_iterations", "1"]
    default = run_in_process(script, argv, tmp_path / "default")
    flash = run_in_process(script, [*argv, "--use_flash_attention"], tmp_path / "flash")
    assert outputs(flash) == outputs(default)
    assert len(outputs(flash)) == 2 and all(outputs(flash))


def test_flag_sends_every_attention_call_to_the_fused_kernel(script, tiny_checkpoint, monkeypatch, capsys):
    layers, steps = 2, 4  # tiny_llama_config's layers; --ignore_eos makes it exactly --max_new_tokens forward calls
    with count_attention_paths(monkeypatch) as counts:
        assert script.main(tiny_argv(tiny_checkpoint, "--use_flash_attention")) == 0
    assert counts["fused"] == layers * steps
    assert counts["default"] == 0
    assert counts[FLASH_KERNEL_CPU] == counts["fused"]  # the real ATen flash kernel ran for each of them
    assert "attention: fused kernel" in capsys.readouterr().out


def test_no_flag_runs_the_default_attention(script, tiny_checkpoint, monkeypatch):
    with count_attention_paths(monkeypatch) as counts:
        assert script.main(tiny_argv(tiny_checkpoint)) == 0
    assert counts["fused"] == 0
    assert counts["default"] == 2 * 4
    assert counts[FLASH_KERNEL_CPU] == 0


def test_every_flash_flag_reaches_the_kernel(script, tiny_checkpoint, monkeypatch):
    """An explicit `--flash_attention_fast_softmax True` survives to the kernel call, like the other companions."""
    calls = []
    fused_sdpa = attention.fused_sdpa

    def recording(*args, **kwargs):
        calls.append((args[0].shape[2], kwargs))  # (query length, kernel arguments)
        return fused_sdpa(*args, **kwargs)

    monkeypatch.setattr(attention, "fused_sdpa", recording)
    flags = [
        "--use_flash_attention",
        "--flash_attention_recompute",
        "--flash_attention_causal_mask",
        "--flash_attention_fast_softmax",
        "True",
    ]
    attention.warn_once.cache_clear()  # a warning already shown in this process is not repeated
    with pytest.warns(UserWarning, match="flash_attention_fast_softmax has no equivalent"):
        assert script.main(tiny_argv(tiny_checkpoint, *flags)) == 0
    prefill = [kwargs for q_len, kwargs in calls if q_len > 1]
    decode = [kwargs for q_len, kwargs in calls if q_len == 1]
    assert prefill and decode
    for kwargs in prefill:
        assert kwargs["softmax_mode"] == "fast"
        assert kwargs["recompute"] is True
        assert kwargs["valid_sequence_lengths"] is not None  # the causal mode with per-row lengths
    for kwargs in decode:  # the core library keeps decode exact and light
        assert kwargs["softmax_mode"] == "None" and kwargs["recompute"] is False


def test_attn_softmax_bf16_reaches_the_default_attention(script, tiny_checkpoint, monkeypatch):
    dtypes = []
    default_attention = attention.matmul_softmax_attention

    def recording(*args, **kwargs):
        dtypes.append(args[6] if len(args) > 6 else kwargs.get("softmax_dtype"))
        return default_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "matmul_softmax_attention", recording)
    assert script.main(tiny_argv(tiny_checkpoint, "--bf16", "--attn_softmax_bf16")) == 0
    assert dtypes and set(dtypes) == {torch.bfloat16}


def parse(argv: list[str]):
    return parse_arguments(build_parser(), argv)


@pytest.mark.parametrize(
    "flag",
    [
        "use_flash_attention",
        "flash_attention_recompute",
        "flash_attention_causal_mask",
        "flash_attention_fast_softmax",
    ],
)
def test_each_flash_flag_lands_in_the_generation_config(flag, tiny_checkpoint):
    argv = (
        ["--use_flash_attention"] if flag == "use_flash_attention" else ["--use_flash_attention", f"--{flag}", "True"]
    )
    arguments = parse(argv)
    model = GaudiLlamaForCausalLM.from_pretrained(tiny_checkpoint)
    config = build_generation_config(model.generation_config, arguments, pad_token_id=0, device=torch.device("cpu"))
    assert getattr(config, flag) is True
    others = {"flash_attention_recompute", "flash_attention_causal_mask", "flash_attention_fast_softmax"} - {flag}
    assert all(getattr(config, name) is False for name in others)
    assert config.attn_softmax_bf16 is False


def test_generation_config_carries_the_workload(tiny_checkpoint):
    arguments = parse(
        ["--max_new_tokens", "7", "--do_sample", "--temperature", "0.5", "--top_k", "5", "--static_shapes"]
        + ["--attn_softmax_bf16"]
    )
    model = GaudiLlamaForCausalLM.from_pretrained(tiny_checkpoint)
    config = build_generation_config(model.generation_config, arguments, pad_token_id=0, device=torch.device("cpu"))
    assert (config.max_new_tokens, config.do_sample, config.temperature, config.top_k) == (7, True, 0.5, 5)
    assert config.cache_implementation == "static"
    assert config.attn_softmax_bf16 is True and config.use_flash_attention is False
    assert config.pad_token_id == 0 and config.compile_config is None


# ---------------------------------------------------------------------------------------------------------------
# Other options, end to end in this process


def test_torch_compile_on_cpu_gives_the_same_texts(script, tiny_checkpoint, tmp_path):
    argv = tiny_argv(tiny_checkpoint)
    eager = run_in_process(script, argv, tmp_path / "eager")
    compiled = run_in_process(script, [*argv, "--torch_compile", "--warmup", "1"], tmp_path / "compiled")
    assert outputs(compiled) == outputs(eager)
    assert compiled["generation_config"]["cache_implementation"] == "static"
    assert compiled["stats"]["compile_seconds"] > 0


def test_beam_search_sampling_and_static_shapes_run(script, tiny_checkpoint, tmp_path):
    """Beam sampling is supported by transformers 5.23 on every device, so --num_beams with --do_sample is accepted."""
    argv = tiny_argv(tiny_checkpoint, "--use_flash_attention", "--num_beams", "2", "--do_sample", "--static_shapes")
    first = run_in_process(script, argv, tmp_path / "first")
    second = run_in_process(script, argv, tmp_path / "second")
    assert outputs(first) == outputs(second)  # --seed is set before every run
    assert first["stats"]["new_tokens"] == 4


def test_chat_template_and_ignore_eos(script, tiny_checkpoint, tmp_path):
    results = run_in_process(script, tiny_argv(tiny_checkpoint, "--chat", "--max_new_tokens", "6"), tmp_path / "chat")
    assert results["stats"]["new_tokens"] == 6
    # The template wraps the prompt: more tokens than the prompt alone.
    assert results["texts"][0]["prompt_tokens"] > 5


def test_peft_adapter_is_merged(script, tiny_checkpoint, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = GaudiLlamaForCausalLM.from_pretrained(tiny_checkpoint)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # non-zero: visible
    get_peft_model(base, lora).save_pretrained(tmp_path / "adapter")

    merged = text_generation.apply_peft_adapter(
        GaudiLlamaForCausalLM.from_pretrained(tiny_checkpoint), tmp_path / "adapter"
    )
    assert type(merged) is GaudiLlamaForCausalLM

    argv = tiny_argv(tiny_checkpoint)
    plain = run_in_process(script, argv, tmp_path / "plain")
    adapted = run_in_process(script, [*argv, "--peft_model", str(tmp_path / "adapter")], tmp_path / "adapted")
    assert adapted["model"]["peft_model"] == str(tmp_path / "adapter")
    assert outputs(adapted) != outputs(plain)


# ---------------------------------------------------------------------------------------------------------------
# The embedded default model


def test_default_model_runs_from_the_cache_and_answers(script, default_model, tmp_path, monkeypatch):
    """The real command, shortened, from a cache that holds the conversion, then a real question."""
    cache_dir, default_model = default_model
    monkeypatch.setenv(CACHE_ENV_VAR, str(cache_dir))
    process = start_script(
        ["--use_flash_attention", "--max_new_tokens", "4", "--warmup", "0", "--n_iterations", "1"]
        + ["--output_dir", str(tmp_path / "first")],
        cache_dir,
    )
    returncode, stdout, stderr = finish(process)
    assert returncode == 0, stderr
    assert "SmolLM2-135M-Instruct" in stdout and "Throughput" in stdout
    results = json.loads((tmp_path / "first" / "results.json").read_text())
    assert results["model"]["source"] == "default"
    assert results["model"]["path"] == str(default_model.path)
    assert results["stats"]["gguf_converted"] is False  # the fixture's conversion is not repeated
    assert results["stats"]["model_load_seconds"] < 15  # the cached checkpoint: about a second on an idle machine
    assert [text["prompt"] for text in results["texts"]] == [DEFAULT_PROMPTS[0]]
    assert results["texts"][0]["output"].strip()

    argv = ["--chat", "--prompt", "What is the capital of France?", "--max_new_tokens", "10"]
    argv += ["--warmup", "0", "--n_iterations", "1"]
    default = run_in_process(script, argv, tmp_path / "default")
    flash = run_in_process(script, [*argv, "--use_flash_attention"], tmp_path / "flash")
    assert "Paris" in outputs(default)[0]
    assert outputs(flash) == outputs(default)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: a one-line message and exit code 2, no traceback


def write_gguf(path: Path, architecture: str) -> Path:
    writer = gguf.GGUFWriter(path, arch=architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


BAD_INPUTS = {
    "missing model path": (["--model_name_or_path", "/no/such/model"], "does not exist"),
    "unknown device": (["--device", "tpu"], "invalid choice: 'tpu'"),
    "hpu not present": (["--device", "hpu"], "no Gaudi device found"),
    "batch size 0": (["--batch_size", "0"], "--batch_size must be at least 1"),
    "max new tokens 0": (["--max_new_tokens", "0"], "--max_new_tokens must be at least 1"),
    "beams 0": (["--num_beams", "0"], "--num_beams must be at least 1"),
    "iterations 0": (["--n_iterations", "0"], "--n_iterations must be at least 1"),
    "bucket internal without bucket size": (["--bucket_internal"], "add --bucket_size N"),
    "static shapes without kv cache": (
        ["--use_kv_cache", "False", "--static_shapes"],
        "--static_shapes shape(s) the KV cache, and --use_kv_cache False turns it off",
    ),
    "buckets without kv cache": (["--use_kv_cache", "False", "--bucket_size", "8"], "--bucket_size shape(s)"),
    "attention batch split 0": (["--attn_batch_split", "0"], "--attn_batch_split must be at least 1"),
    "two prompt sources": (["--prompt", "Hi", "--book_source"], "--prompt and --book_source both give the prompt"),
    "missing prompt file": (["--prompt_file", "/no/such/file.txt"], "--prompt_file '/no/such/file.txt': no such file"),
    "hpu graphs with compile": (["--use_hpu_graphs", "--torch_compile"], "choose one"),
    "empty prompt": (["--prompt", "Hello", "  "], "--prompt number 2 is empty"),
    "recompute without flash": (
        ["--flash_attention_recompute"],
        "`flash_attention_recompute` requires `use_flash_attention`",
    ),
    "causal mask without flash": (
        ["--flash_attention_causal_mask"],
        "`flash_attention_causal_mask` requires `use_flash_attention`",
    ),
    "fast softmax without flash": (
        ["--flash_attention_fast_softmax", "True"],
        "`flash_attention_fast_softmax` requires `use_flash_attention`",
    ),
    "temperature without sampling": (["--temperature", "0.7"], "--temperature only applies to sampling"),
    "temperature nan": (["--do_sample", "--temperature", "nan"], "--temperature must be a finite number, got nan"),
    "top_p inf": (["--do_sample", "--top_p", "inf"], "--top_p must be a finite number, got inf"),
    "negative seed": (["--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
    "seed too large": (["--seed", str(2**32)], "--seed must be in [0, 4294967295]"),
    # Checked before tokenizing: padding every prompt to 1e8 tokens would take minutes and gigabytes.
    "max input tokens beyond positions": (["--max_input_tokens", "100000000"], "--max_input_tokens (100000000)"),
    "not a boolean": (["--use_flash_attention", "maybe"], "argument --use_flash_attention"),
    "unknown argument": (["--use_flash_attentoin"], "unrecognized arguments: --use_flash_attentoin"),
}
if not torch.cuda.is_available():
    BAD_INPUTS["cuda not present"] = (["--device", "cuda"], "no CUDA device found")


@pytest.mark.parametrize("argv, message", list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
def test_bad_arguments_are_usage_errors(script, tiny_checkpoint, argv, message, capsys):
    full_argv = ["--model_name_or_path", str(tiny_checkpoint), *argv]
    with pytest.raises(SystemExit) as exit_info:
        script.main(full_argv)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert message in stderr
    assert "Traceback" not in stderr


def save_gpt2_config(folder: Path) -> Path:
    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(folder)
    return folder


def bad_model_inputs(tiny_checkpoint: Path, folder: Path) -> dict[str, tuple[list[str], str]]:
    no_template = folder / "no_chat_template"
    if not no_template.exists():
        shutil.copytree(tiny_checkpoint, no_template)
        (no_template / "chat_template.jinja").unlink()
    return {
        "gguf of another architecture": (
            ["--model_name_or_path", str(write_gguf(folder / "gpt2.gguf", "gpt2"))],
            "supported GGUF architectures: llama, mistral",
        ),
        "family without a Gaudi class": (
            ["--model_name_or_path", str(save_gpt2_config(folder / "gpt2"))],
            "is a 'gpt2' model, which has no Gaudi class; supported model types: llama, mistral, mixtral",
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
        "missing adapter": (
            ["--model_name_or_path", str(tiny_checkpoint), "--peft_model", str(folder / "nothing")],
            "is not a folder",
        ),
        **bad_adapters(tiny_checkpoint, folder),
    }


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
    from peft import LoraConfig, get_peft_model

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


def test_bad_models_are_usage_errors(script, tiny_checkpoint, tmp_path, capsys):
    for name, (argv, message) in bad_model_inputs(tiny_checkpoint, tmp_path).items():
        with pytest.raises(SystemExit) as exit_info:
            script.main(argv)
        stderr = capsys.readouterr().err
        assert exit_info.value.code == 2, name
        assert message in stderr, (name, stderr)
        assert "Traceback" not in stderr, name


def test_bad_input_from_the_command_line_has_no_traceback(tiny_checkpoint, cache_dir):
    """The same errors through a real process: exit code 2, one message, no traceback."""
    runs = {
        "does not exist": ["--model_name_or_path", "/no/such/model"],
        "--batch_size must be at least 1": ["--model_name_or_path", str(tiny_checkpoint), "--batch_size", "0"],
    }
    processes = {message: start_script(argv, cache_dir) for message, argv in runs.items()}
    for message, process in processes.items():
        returncode, stdout, stderr = finish(process)
        assert returncode == 2
        assert message in stderr
        assert "Traceback" not in stderr
        assert stderr.strip().splitlines()[-1].startswith("run_generation.py: error: ")


# ---------------------------------------------------------------------------------------------------------------
# Helpers


def test_prompts_are_cycled_to_fill_the_batch():
    assert prompts_for_batch(["a", "b"], 5) == ["a", "b", "a", "b", "a"]
    assert prompts_for_batch(prompt_pool(parse([]).workload), 2) == list(DEFAULT_PROMPTS[:2])


def test_prompt_flag_repeats_and_takes_several_values():
    arguments = parse(["--prompt", "a", "--prompt", "b", "c"])
    assert arguments.workload.prompt == ["a", "b", "c"]
    assert parse([]).workload.prompt is None


def test_boolean_flags_with_and_without_values():
    assert parse([]).workload.bf16 is None
    assert parse(["--bf16"]).workload.bf16 is True
    assert parse(["--bf16", "False"]).workload.bf16 is False
    explicit = parse(["--use_flash_attention", "True", "--flash_attention_fast_softmax", "True"]).attention
    assert explicit.use_flash_attention is True and explicit.flash_attention_fast_softmax is True


def test_prompts_are_left_padded_and_truncated_from_the_left(tiny_checkpoint):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_checkpoint)
    long_prompt = PROMPTS_OF_THREE_LENGTHS[1]
    full = tokenizer(long_prompt)["input_ids"]
    inputs, lengths = tokenize_prompts(tokenizer, ["Hello", long_prompt], max_input_tokens=8, chat=False)
    assert inputs["input_ids"].shape == (2, 8)
    assert lengths == [len(tokenizer("Hello")["input_ids"]), len(full)]
    assert inputs["attention_mask"][0].tolist()[-1] == 1 and inputs["attention_mask"][0].tolist()[0] == 0
    assert inputs["input_ids"][1].tolist() == full[-8:]  # the end of the prompt is what the model continues

    unpadded, _ = tokenize_prompts(tokenizer, ["Hello", long_prompt], max_input_tokens=0, chat=False)
    assert unpadded["input_ids"].shape == (2, len(full))


def test_stats_are_medians_of_the_measured_runs():
    runs = [RunMeasurement(2.0, 0.2, 10), RunMeasurement(1.0, 0.1, 10), RunMeasurement(4.0, 0.4, 10)]
    stats = summarize_runs(runs, batch_size=3)
    assert stats["throughput_tokens_per_second"] == pytest.approx(15.0)  # 3 x 10 / 2.0 s
    assert stats["first_token_latency_seconds"] == pytest.approx(0.2)
    assert stats["generation_seconds"] == pytest.approx(2.0)
    assert stats["new_tokens"] == 10 and len(stats["runs"]) == 3


def test_sequence_length_check():
    check_sequence_length(100, 28, 128, fixed=True)
    with pytest.raises(ValueError, match=r"--max_input_tokens \(100\) \+ --max_new_tokens \(29\) = 129"):
        check_sequence_length(100, 29, 128, fixed=True)
    check_sequence_length(10_000, 10, None, fixed=False)  # no limit known: nothing to check


class StubModel:
    """generate() that takes 30 ms, its first token ready after 10 ms, and adds 3 tokens."""

    def generate(self, input_ids, attention_mask, generation_config, logits_processor):
        time.sleep(0.01)
        logits_processor(input_ids, torch.zeros(input_ids.shape[0], 8))
        time.sleep(0.02)
        return torch.cat([input_ids, torch.zeros(input_ids.shape[0], 3, dtype=torch.long)], dim=1)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_benchmark_times_the_measured_runs_and_shows_progress_on_a_terminal(monkeypatch):
    inputs = BatchEncoding({"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5)})
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    result = benchmark(StubModel(), inputs, None, device=torch.device("cpu"), seed=0, warmup=1, n_iterations=2)
    assert len(result.runs) == 2 and result.output.shape == (2, 8)
    for run in result.runs:
        assert run.new_tokens == 3
        assert 0.01 <= run.first_token_seconds < run.seconds
        assert run.seconds >= 0.03
    assert result.warmup_seconds >= 0.03
    assert "generate" in terminal.getvalue() and "3/3" in terminal.getvalue()

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no progress bar
    benchmark(StubModel(), inputs, None, device=torch.device("cpu"), seed=0, warmup=0, n_iterations=1)
    assert sys.stderr.getvalue() == ""
