"""run_generation.py end to end: the same texts with and without the flag, every flag reaching the kernel, every
family, the generation config, compile, beam search, chat, adapters and the embedded model.

End-to-end runs use a tiny random Llama saved with a tokenizer trained here (no download); the embedded
SmolLM2-135M-Instruct is converted once per session, into a cache of its own, for a real answer.
Torch runs on one thread here, and so do the scripts started here: two processes with two threads each on a
2-core machine (pytest -n 2) slow each other down many times over.
"""

import json

import pytest
import torch

from optimum.habana import GaudiLlamaForCausalLM
from optimum.habana.cli import adapters
from optimum.habana.cli.generation.generation_config import build_generation_config
from optimum.habana.cli.generation.prompts import (
    DEFAULT_PROMPTS,
)
from optimum.habana.transformers import attention
from optimum.habana.utils.model_loading import CACHE_ENV_VAR
from tests.generation.support import (
    PROMPTS_OF_THREE_LENGTHS,
    finish,
    outputs,
    parse,
    run_in_process,
    start_script,
    tiny_argv,
)
from tests.helpers import FAMILIES, FUSED_KERNEL_CPU, count_attention_paths, save_tiny_checkpoint, spy_on_fused_kernel


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
# End to end, in subprocesses, on the tiny checkpoint


def test_end_to_end_same_greedy_texts_with_and_without_flash_attention(script, tiny_checkpoint, cache_dir, tmp_path):
    """Batch 1, and batch 3 with prompts of different lengths padded to --max_input_tokens. The flag's batch-3 run
    is the command as users type it, in a process of its own; the other three run in this process."""
    common = ["--model_name_or_path", str(tiny_checkpoint), "--max_new_tokens", "8", "--n_iterations", "2"]
    workloads = {
        "batch1": ["--prompt", "Gaudi is an accelerator"],
        "batch3": ["--prompt", *PROMPTS_OF_THREE_LENGTHS, "--batch_size", "3", "--max_input_tokens", "20"],
    }
    command = [*common, *workloads["batch3"], "--use_flash_attention", "--output_dir", str(tmp_path / "command")]
    process = start_script(command, cache_dir)
    results = {
        (name, flash): run_in_process(
            script, [*common, *workload, *(["--use_flash_attention"] if flash else [])], tmp_path / f"{name}-{flash}"
        )
        for name, workload in workloads.items()
        for flash in (False, True)
        if (name, flash) != ("batch3", True)
    }
    returncode, stdout, stderr = finish(process)
    assert returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "Output:" in stdout and "Throughput" in stdout and "Average first token latency" in stdout
    results["batch3", True] = json.loads((tmp_path / "command" / "results.json").read_text())

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


@pytest.mark.parametrize("model_type", FAMILIES)
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
    assert counts[FUSED_KERNEL_CPU] == counts["fused"]  # the real ATen flash kernel ran for each of them
    assert "attention: fused kernel" in capsys.readouterr().out


def test_no_flag_runs_the_default_attention(script, tiny_checkpoint, monkeypatch):
    with count_attention_paths(monkeypatch) as counts:
        assert script.main(tiny_argv(tiny_checkpoint)) == 0
    assert counts["fused"] == 0
    assert counts["default"] == 2 * 4
    assert counts[FUSED_KERNEL_CPU] == 0


def test_every_flash_flag_reaches_the_kernel(script, tiny_checkpoint, monkeypatch):
    """An explicit `--flash_attention_fast_softmax True` survives to the kernel call, like the other companions."""
    calls = []

    def recording(fused_sdpa):
        def spy(*args, **kwargs):
            calls.append((args[0].shape[2], args[3], kwargs))  # (query length, mask, kernel arguments)
            return fused_sdpa(*args, **kwargs)

        return spy

    spy_on_fused_kernel(monkeypatch, recording)
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
    prefill = [(mask, kwargs) for q_len, mask, kwargs in calls if q_len > 1]
    decode = [kwargs for q_len, _, kwargs in calls if q_len == 1]
    assert prefill and decode
    for mask, kwargs in prefill:
        assert kwargs["softmax_mode"] == "fast"
        assert kwargs["recompute"] is True
        assert mask is None and kwargs["is_causal"]  # the causal mode, over each row's real tokens
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


@pytest.mark.parametrize("flag", [[], ["--use_flash_attention"]], ids=["default path", "flag"])
def test_torch_compile_on_cpu_gives_the_same_texts(script, tiny_checkpoint, tmp_path, flag, capsys):
    """The prompt (padded) and the decode step compiled, each as one graph: two graphs, no graph break."""
    argv = tiny_argv(tiny_checkpoint, *flag)
    eager = run_in_process(script, argv, tmp_path / "eager")
    compile_argv = [*argv, "--torch_compile", "--torch_compile_backend", "eager", "--warmup", "1"]
    compiled = run_in_process(script, compile_argv, tmp_path / "compiled")
    assert outputs(compiled) == outputs(eager)
    assert compiled["generation_config"]["cache_implementation"] == "static"
    assert compiled["stats"]["compile_seconds"] > 0
    assert (compiled["stats"]["compiled_graphs"], compiled["stats"]["graph_breaks"]) == (2, 0)
    assert "torch.compile (eager): 2 graph(s) compiled" in capsys.readouterr().err


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

    merged = adapters.apply_peft_adapter(GaudiLlamaForCausalLM.from_pretrained(tiny_checkpoint), tmp_path / "adapter")
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
