"""run_generation.py with Optimum-Habana's flags: each one does what it means here, or says what it does."""

import functools
import json
import os
import re
import sys
import types

import gguf
import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch._dynamo.utils import counters
from transformers import GenerationConfig

from optimum.habana import GaudiLlamaForCausalLM, hpu
from optimum.habana.cli.common import LONG_PROMPT_PATH
from optimum.habana.cli.generation import generation_config
from optimum.habana.cli.generation.arguments import flag_notes
from optimum.habana.cli.generation.capture import compile_backend
from optimum.habana.cli.generation.explain import explain
from optimum.habana.cli.generation.generation_config import build_generation_config, compile_config_for
from optimum.habana.transformers import attention
from optimum.habana.transformers.cache import BucketedStaticCache
from optimum.habana.utils import devices, model_loading
from tests.generation.support import bad_model_inputs, outputs, parse, run_in_process, tiny_argv
from tests.helpers import count_decode_kernel_calls, save_tiny_checkpoint, spy_on_fused_kernel, tiny_config, write_gguf


@pytest.fixture
def attention_calls(monkeypatch):
    """Every attention call: (path, query length, key length, kernel keyword arguments)."""
    calls = []
    default = attention.matmul_softmax_attention

    def fused_spy(fused):
        def spy(query, key, value, mask, **kwargs):
            calls.append(("fused", query.shape[2], key.shape[2], {"mask": mask is not None, **kwargs}))
            return fused(query, key, value, mask, **kwargs)

        return spy

    def default_spy(query, key, value, mask, *args, **kwargs):
        calls.append(("default", query.shape[2], key.shape[2], {"mask": mask is not None, **kwargs}))
        return default(query, key, value, mask, *args, **kwargs)

    spy_on_fused_kernel(monkeypatch, fused_spy)
    monkeypatch.setattr(attention, "matmul_softmax_attention", default_spy)
    return calls


# ---------------------------------------------------------------------------------------------------------------
# Parsing: upstream spellings, abbreviations, defaults


def test_upstream_spellings_and_abbreviations_parse():
    arguments = parse(
        ["--warm", "2", "--n_iter", "4", "--no-ignore_eos", "--use_kv_cache", "--max_input_tokens", "-1"]
    )
    assert arguments.execution.warmup == 2 and arguments.execution.n_iterations == 4
    assert arguments.workload.ignore_eos is False and arguments.workload.use_kv_cache is True
    assert parse([]).workload.ignore_eos is True  # Optimum-Habana's default
    assert parse(["--no_ignore_eos"]).workload.ignore_eos is False
    assert parse(["--use_kv_cache", "False"]).workload.use_kv_cache is False


def test_max_input_tokens_zero_and_negative_leave_prompts_as_they_are(script, tiny_checkpoint, tmp_path):
    zero = run_in_process(script, tiny_argv(tiny_checkpoint, "--max_input_tokens", "0"), tmp_path / "zero")
    negative = run_in_process(script, tiny_argv(tiny_checkpoint, "--max_input_tokens", "-1"), tmp_path / "negative")
    assert outputs(zero) == outputs(negative)
    assert zero["stats"]["input_tokens"] == negative["stats"]["input_tokens"]


# ---------------------------------------------------------------------------------------------------------------
# Cache and generation flags: observable effects


def test_use_kv_cache_false_recomputes_the_whole_sequence(script, tiny_checkpoint, tmp_path, attention_calls):
    cached = run_in_process(script, tiny_argv(tiny_checkpoint, "--use_flash_attention"), tmp_path / "cached")
    cached_queries = [q_len for _, q_len, _, _ in attention_calls]
    attention_calls.clear()
    argv = tiny_argv(tiny_checkpoint, "--use_flash_attention", "--use_kv_cache", "False")
    uncached = run_in_process(script, argv, tmp_path / "uncached")
    assert outputs(uncached) == outputs(cached)
    assert 1 in cached_queries  # decode steps read one new token against the cache
    assert min(q_len for _, q_len, _, _ in attention_calls) > 1  # without it every step reads the whole sequence
    assert uncached["generation_config"]["use_cache"] is False


def test_ignore_eos_keeps_generating_with_the_same_tokens():
    torch.manual_seed(0)
    model = GaudiLlamaForCausalLM(tiny_config("llama")).eval()
    input_ids = torch.randint(3, 100, (1, 6))
    reference = model.generate(input_ids=input_ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    model.generation_config.eos_token_id = int(reference[0, 8])  # a token the model emits at the third step
    stops_at = int((reference[0, 6:] == reference[0, 8]).nonzero()[0]) + 1
    for argv, new_tokens in (
        (["--max_new_tokens", "12"], 12),
        (["--max_new_tokens", "12", "--no-ignore_eos"], stops_at),
    ):
        config = build_generation_config(model.generation_config, parse(argv), 0, torch.device("cpu"))
        output = model.generate(input_ids=input_ids, generation_config=config)
        assert output.shape[1] - 6 == new_tokens
        assert torch.equal(output[0], reference[0, : 6 + new_tokens])  # ignoring EOS never changes a token


def test_trim_logits_is_a_note_and_the_prompt_logits_are_one_position(script, tiny_checkpoint, capsys, monkeypatch):
    lm_head_positions = []
    forward = GaudiLlamaForCausalLM.forward

    @functools.wraps(forward)  # generate() reads the forward's signature
    def recording(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        lm_head_positions.append(output.logits.shape[1])
        return output

    monkeypatch.setattr(GaudiLlamaForCausalLM, "forward", recording)
    assert script.main(tiny_argv(tiny_checkpoint, "--trim_logits")) == 0
    assert set(lm_head_positions) == {1}  # the prompt's forward too
    stderr = capsys.readouterr().err
    assert stderr.count("--trim_logits: always the case here") == 1


def test_reuse_cache_allocates_one_cache_for_every_run(script, tiny_checkpoint, tmp_path, monkeypatch):
    dynamic = run_in_process(script, tiny_argv(tiny_checkpoint), tmp_path / "dynamic")
    supplied = []
    supply = generation_config.KVCacheSupply.__call__

    def recording(self):
        cache = supply(self)
        supplied.append(cache)
        return cache

    monkeypatch.setattr(generation_config.KVCacheSupply, "__call__", recording)
    argv = tiny_argv(tiny_checkpoint, "--reuse_cache", "--warmup", "1", "--n_iterations", "2")
    reused = run_in_process(script, argv, tmp_path / "reused")
    assert outputs(reused) == outputs(dynamic)
    assert len(supplied) == 3 and all(cache is supplied[0] for cache in supplied)
    assert reused["stats"]["kv_cache_allocations"] == 1
    assert "allocated once and reused by every run" in reused["stats"]["kv_cache"]
    # Without --reuse_cache every run allocates its own (here a bucketed one, which the script builds itself).
    argv = tiny_argv(tiny_checkpoint, "--bucket_size", "4", "--warmup", "1", "--n_iterations", "2")
    assert run_in_process(script, argv, tmp_path / "fresh")["stats"]["kv_cache_allocations"] == 3


@pytest.mark.parametrize("flash", [False, True], ids=["default", "flash"])
@pytest.mark.parametrize("internal", [False, True], ids=["grown", "internal"])
def test_bucketed_cache_same_tokens_and_decode_reads_filled_buckets(
    script, tiny_checkpoint, tmp_path, attention_calls, flash, internal
):
    extra = ["--use_flash_attention"] if flash else []
    dynamic = run_in_process(script, tiny_argv(tiny_checkpoint, *extra, "--max_new_tokens", "12"), tmp_path / "dyn")
    attention_calls.clear()
    bucket = ["--bucket_size", "4", *(["--bucket_internal"] if internal else [])]
    argv = tiny_argv(tiny_checkpoint, *extra, "--max_new_tokens", "12", *bucket)
    bucketed = run_in_process(script, argv, tmp_path / "bucketed")
    assert outputs(bucketed) == outputs(dynamic)
    prompt_length = bucketed["stats"]["input_tokens"]
    decode_keys = [kv for _, q_len, kv, _ in attention_calls if q_len == 1][::2]  # two layers per step
    expected = [min(-(-(prompt_length + step) // 4) * 4, prompt_length + 12) for step in range(1, 12)]
    assert decode_keys == expected  # the filled buckets, not prompt + max_new_tokens from the first step
    assert {path for path, *_ in attention_calls} == {"fused" if flash else "default"}


def test_bucketed_cache_compiles_one_graph_per_bucket_not_per_step():
    torch.manual_seed(0)
    model = GaudiLlamaForCausalLM(tiny_config("llama")).eval()
    input_ids = torch.randint(3, 100, (2, 5))
    greedy = {"max_new_tokens": 14, "min_new_tokens": 14, "do_sample": False}
    reference = model.generate(input_ids=input_ids, **greedy)
    model.generation_config.compile_config = compile_config_for(torch.device("cpu"))
    cache = BucketedStaticCache(model.config, max_cache_len=19, bucket_size=8, preallocate=True)
    counters.clear()
    torch._dynamo.reset()
    output = model.generate(input_ids=input_ids, past_key_values=cache, use_flash_attention=True, **greedy)
    assert torch.equal(output, reference)
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 3  # decode lengths 6..18 fill buckets 8, 16 and 19 (the cap): 13 steps, 3 shapes at most


# ---------------------------------------------------------------------------------------------------------------
# Flags that have no meaning here say so, once


NOTES = {
    "--use_hpu_graphs": "--use_hpu_graphs: HPU graphs exist on Gaudi only; on cpu the model runs without them",
    "--limit_hpu_graphs": "--limit_hpu_graphs: no effect without HPU graphs",
    "--sdp_on_bf16": "--sdp_on_bf16: PyTorch's math SDPA backend may now reduce in bf16/fp16",
    "--attn_batch_split=2": "--attn_batch_split 2: no effect here",
    "--attn_softmax_bf16": "--attn_softmax_bf16: the model runs in float32",
    "--bucket_size=0": "--bucket_size 0: no bucketing, as with -1",  # Optimum-Habana reads <= 0 as off
}


@pytest.mark.parametrize("flag", list(NOTES))
def test_flags_without_effect_here_print_one_note(script, tiny_checkpoint, tmp_path, capsys, flag):
    plain = run_in_process(script, tiny_argv(tiny_checkpoint), tmp_path / "plain")
    capsys.readouterr()
    noted = run_in_process(script, tiny_argv(tiny_checkpoint, flag), tmp_path / "noted")
    assert capsys.readouterr().err.count(NOTES[flag]) == 1
    assert outputs(noted) == outputs(plain)
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)


def test_gaudis_compile_backend_elsewhere_is_inductor_and_says_so():
    """Optimum-Habana's commands pass --torch_compile_backend hpu_backend; off Gaudi it would fail inside dynamo."""
    arguments = parse(["--torch_compile", "--torch_compile_backend", "hpu_backend"])
    cpu = torch.device("cpu")
    notes = flag_notes(arguments, cpu, torch.float32)
    assert "--torch_compile_backend hpu_backend: Gaudi's compiler; on cpu torch.compile uses inductor." in notes
    assert compile_backend(arguments.execution, cpu) == "inductor"
    assert compile_backend(arguments.execution, torch.device("hpu")) == "hpu_backend"
    config = build_generation_config(GenerationConfig(), arguments, 0, cpu)
    assert config.compile_config.backend == "inductor"
    eager = parse(["--torch_compile", "--torch_compile_backend", "eager"])
    assert build_generation_config(GenerationConfig(), eager, 0, cpu).compile_config.backend == "eager"
    assert not any("torch_compile_backend" in note for note in flag_notes(eager, cpu, torch.float32))


def test_bf16_on_a_cpu_that_emulates_it_says_so_once(script, tiny_checkpoint, tmp_path, capsys, monkeypatch):
    note = "--bf16: bfloat16 on this CPU is emulated"
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: False)
    run_in_process(script, tiny_argv(tiny_checkpoint, "--bf16"), tmp_path / "emulated")
    assert capsys.readouterr().err.count(note) == 1
    run_in_process(script, tiny_argv(tiny_checkpoint), tmp_path / "float32")
    assert note not in capsys.readouterr().err
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: True)
    run_in_process(script, tiny_argv(tiny_checkpoint, "--bf16"), tmp_path / "native")
    assert note not in capsys.readouterr().err
    assert devices.slow_bf16_note(torch.device("cuda"), torch.bfloat16) is None


def test_sdp_on_bf16_sets_torchs_switch(script, tiny_checkpoint, tmp_path):
    try:
        run_in_process(script, tiny_argv(tiny_checkpoint, "--sdp_on_bf16"), tmp_path)
        assert torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)


def test_attn_softmax_bf16_with_flash_is_accepted_with_one_note(script, tiny_checkpoint, tmp_path, capsys):
    flash = run_in_process(script, tiny_argv(tiny_checkpoint, "--use_flash_attention", "--bf16"), tmp_path / "f")
    capsys.readouterr()
    argv = tiny_argv(tiny_checkpoint, "--use_flash_attention", "--bf16", "--attn_softmax_bf16")
    both = run_in_process(script, argv, tmp_path / "both")
    stderr = capsys.readouterr().err
    assert stderr.count("attn_softmax_bf16") == 1 and "the fused kernel computes its own softmax" in stderr
    assert outputs(both) == outputs(flash)


def test_limit_hpu_graphs_keeps_the_prompt_out_of_the_graph(monkeypatch):
    """On Gaudi: the wrapper replays graphs for decode steps only (habana_frameworks replaced by a recorder)."""
    recorded = []

    def wrap_in_hpu_graph(module):
        eager = module.forward
        module.forward = lambda *args, **kwargs: (recorded.append("graph"), eager(*args, **kwargs))[1]
        return module

    fake = types.ModuleType("habana_frameworks.torch.hpu")
    fake.wrap_in_hpu_graph = wrap_in_hpu_graph
    for name in ("habana_frameworks", "habana_frameworks.torch"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch.hpu", fake)
    torch.manual_seed(0)
    model = hpu.wrap_in_hpu_graph(GaudiLlamaForCausalLM(tiny_config("llama")).eval(), prompt_in_graph=False)
    prompt = torch.randint(3, 100, (1, 5))
    model.generate(input_ids=prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert recorded == ["graph"] * 3  # four forwards: the prompt eagerly, three decode steps through the graph
    recorded.clear()
    embeds = model.get_input_embeddings()(prompt)
    model.generate(inputs_embeds=embeds, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert recorded == ["graph"] * 3  # a prompt given as embeddings runs eagerly too


@pytest.mark.parametrize(
    "flags, full_layer_elsewhere",
    [(["--use_hpu_graphs", "--reuse_cache"], "StaticLayer"), (["--use_hpu_graphs", "--bucket_size", "4"], None)],
    ids=["reused static", "bucketed"],
)
def test_on_gaudi_the_scripts_caches_hold_window_layers_at_full_length(flags, full_layer_elsewhere):
    """HPU graphs replay no Python: transformers' static window layers, which branch on a Python count inside the
    forward, would write past their window on a replay. On Gaudi every layer of a cache the script builds is a
    bucketed full-length one (the mask applies the window; generate()'s own are tested in test_hpu_kernel.py);
    elsewhere the window layers stay transformers' own."""
    config = tiny_config("gemma3_text", sliding_window=4, sliding_window_pattern=2, num_hidden_layers=2)
    elsewhere = ["StaticSlidingWindowLayer", full_layer_elsewhere or "BucketedStaticLayer"]
    for device, expected in ((torch.device("hpu"), ["BucketedStaticLayer"] * 2), (torch.device("cpu"), elsewhere)):
        layout = generation_config.kv_cache_layout(parse(flags), device)
        cache = generation_config.KVCacheSupply(layout, config, max_cache_len=16)()
        assert [type(layer).__name__ for layer in cache.layers] == expected


# ---------------------------------------------------------------------------------------------------------------
# Long prompts


def test_prompt_file_and_book_source(script, tiny_checkpoint, tmp_path, capsys):
    text = LONG_PROMPT_PATH.read_text(encoding="utf-8")
    assert len(text) > 40_000 and text.isascii()
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("A story about a lighthouse keeper who collects shells.\n", encoding="utf-8")
    argv = ["--model_name_or_path", str(tiny_checkpoint), "--max_new_tokens", "3", "--warmup", "0"]
    argv += ["--n_iterations", "1"]
    from_file = run_in_process(script, [*argv, "--prompt_file", str(prompt_file)], tmp_path / "file")
    assert from_file["input"] == [prompt_file.read_text(encoding="utf-8")]
    book = run_in_process(script, [*argv, "--book_source", "--max_input_tokens", "64"], tmp_path / "book")
    assert book["stats"]["input_tokens"] == 64 and book["texts"][0]["prompt_tokens"] > 64
    assert "keep their last tokens" in capsys.readouterr().err
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(SystemExit) as exit_info:
        script.main([*argv, "--prompt_file", str(tmp_path / "latin1.txt")])
    assert exit_info.value.code == 2
    assert "is not UTF-8 text" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# results.json: Optimum-Habana's keys, equal to the printed stats


def test_results_json_has_optimum_habana_keys_equal_to_the_printed_stats(script, tiny_checkpoint, tmp_path, capsys):
    results = run_in_process(script, tiny_argv(tiny_checkpoint, "--n_iterations", "2"), tmp_path)
    printed = dict(
        re.match(r"(.+?)\s+= (.+)", line).groups() for line in capsys.readouterr().out.splitlines() if " = " in line
    )
    assert float(printed["Throughput (median of 2 runs)"].split()[0]) == round(results["throughput"], 2)
    for label, key in (
        ("Average first token latency", "avg_first_token_latency"),
        ("Average rest token latency", "avg_rest_token_latency"),
        ("Average end to end latency", "avg_e2e_latency"),
    ):
        assert float(printed[label].removesuffix(" ms")) == round(results[key] * 1000, 1)  # JSON in seconds
    assert results["input"] == [text["prompt"] for text in results["texts"]]
    for row, text in zip(results["output"], results["texts"], strict=True):  # Optimum-Habana's: prompt and new text
        assert len(row) == 1 and text["output"].strip() in row[0] and len(row[0]) > len(text["output"])
    assert "Total memory available" in printed and int(printed["Input tokens"]) == results["stats"]["input_tokens"]


# ---------------------------------------------------------------------------------------------------------------
# Optimum-Habana README command lines (examples/text-generation/README.md, Llama with flash attention): launcher
# (gaudi_spawn.py, DeepSpeed, environment variables) removed, the model replaced by a tiny local one, and batch and
# lengths scaled down so that they finish in seconds.

README_COMMANDS = {
    "bf16 flash, hpu graphs, reuse cache": "--use_hpu_graphs --limit_hpu_graphs --use_kv_cache --max_input_tokens 16 "
    "--max_new_tokens 8 --batch_size 4 --bf16 --reuse_cache --trim_logits --use_flash_attention "
    "--flash_attention_recompute --attn_softmax_bf16",
    "flash with causal mask": "--use_hpu_graphs --use_kv_cache --reuse_cache --bf16 --batch_size 2 "
    "--max_new_tokens 8 --max_input_tokens 16 --attn_softmax_bf16 --use_flash_attention "
    "--flash_attention_recompute --flash_attention_causal_mask",
    "fast softmax": "--use_hpu_graphs --use_kv_cache --limit_hpu_graphs --max_input_tokens 16 --max_new_tokens 8 "
    "--batch_size 2 --bf16 --use_flash_attention --flash_attention_recompute --flash_attention_causal_mask "
    "--flash_attention_fast_softmax",
    "book source with buckets": "--use_hpu_graphs --limit_hpu_graphs --use_kv_cache --bf16 --batch_size 2 "
    "--attn_softmax_bf16 --max_new_tokens 8 --max_input_tokens 32 --bucket_size 8 --bucket_internal "
    "--book_source --use_flash_attention --flash_attention_recompute --trim_logits --warmup 1 --n_iterations 1",
    "sdp on bf16, batch split": "--use_hpu_graphs --use_kv_cache --max_new_tokens 8 --bf16 --batch_size 2 "
    "--sdp_on_bf16 --attn_batch_split 2 --use_flash_attention --flash_attention_causal_mask",
}


@pytest.mark.parametrize("command", list(README_COMMANDS.values()), ids=list(README_COMMANDS))
def test_optimum_habana_readme_commands_run(script, tiny_checkpoint, tmp_path, command):
    try:
        argv = ["--model_name_or_path", str(tiny_checkpoint), "--warmup", "1", "--n_iterations", "1"]
        results = run_in_process(script, [*argv, *command.split()], tmp_path)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)
    assert results["throughput"] > 0 and all(row[0] for row in results["output"])
    assert results["stats"]["compile_seconds"] is None  # HPU graphs off Gaudi: nothing was compiled


# ---------------------------------------------------------------------------------------------------------------
# --explain


def explain_text(tiny_checkpoint, *extra: str) -> str:
    return explain(parse(tiny_argv(tiny_checkpoint, *extra)))


def account(call) -> tuple[str, ...]:
    """The words --explain must use for a recorded call."""
    path, q_len, _, kwargs = call
    if path == "default":
        return ("default path",)
    if kwargs.get("valid_sequence_lengths") is not None:
        return ("attn_mask=None, is_causal=True, valid lengths per row",)
    if kwargs["mask"]:
        return ("attn_mask=boolean", "is_causal=False")
    return (f"attn_mask=None, is_causal={kwargs['is_causal']}",)


EXPLAINED = {
    "default": [],
    "flash": ["--use_flash_attention"],
    "flash causal mask": ["--use_flash_attention", "--flash_attention_causal_mask"],
    "flash static": ["--use_flash_attention", "--static_shapes"],
    "flash buckets": ["--use_flash_attention", "--bucket_size", "4", "--bucket_internal"],
    "flash batch 1": ["--use_flash_attention", "--batch_size", "1"],
    "flash without cache": ["--use_flash_attention", "--flash_attention_causal_mask", "--use_kv_cache", "False"],
    "flash without cache, batch 1": ["--use_flash_attention", "--use_kv_cache", "False", "--batch_size", "1"],
}


@pytest.mark.parametrize("extra", list(EXPLAINED.values()), ids=list(EXPLAINED))
def test_explain_says_what_the_run_does(script, tiny_checkpoint, tmp_path, attention_calls, monkeypatch, extra):
    text = explain_text(tiny_checkpoint, *extra)
    decode_kernel_calls = count_decode_kernel_calls(monkeypatch)
    run_in_process(script, tiny_argv(tiny_checkpoint, *extra), tmp_path)
    sections = text.split("  decode")
    prefill_lines, decode_lines = sections[0].split("  prefill")[1], sections[1]
    prompt_length = attention_calls[0][1]
    for call in attention_calls:
        lines = prefill_lines if call[1] == prompt_length else decode_lines
        assert all(words in lines for words in account(call)), (call, text)
    fused = "--use_flash_attention" in extra
    assert ("fused kernel" in prefill_lines) == fused and ("fused kernel" in decode_lines) == fused
    assert ("the CPU decode kernel" in decode_lines) == bool(decode_kernel_calls), text


def test_explain_lists_the_flags_and_loads_no_weights(tiny_checkpoint, monkeypatch):
    reader_class = gguf.GGUFReader

    def no_weights(*args, **kwargs):
        raise AssertionError("--explain loaded weights")

    monkeypatch.setattr(GaudiLlamaForCausalLM, "from_pretrained", no_weights)
    monkeypatch.setattr(model_loading, "_convert_gguf", no_weights)
    text = explain_text(tiny_checkpoint, "--use_flash_attention", "--trim_logits", "--use_hpu_graphs")
    assert "--use_flash_attention = True (given): fused kernel for every attention call" in text
    assert "--flash_attention_recompute = False (default)" in text
    assert "--use_kv_cache = True (default)" in text
    assert "--trim_logits: always the case here" in text and "--use_hpu_graphs: HPU graphs exist on Gaudi only" in text
    assert "KV cache: dynamic" in text
    parses = []
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args: parses.append(args) or reader_class(*args))
    default_model = explain(parse(["--explain"]))  # the embedded .gguf: its metadata only, no conversion
    assert "GGUF metadata" in default_model and "GaudiLlamaForCausalLM, 30 attention layers" in default_model
    assert len(parses) == 1  # the config and the tokenizer from one parse (4 s each for SmolLM2)


def test_explain_reads_an_earlier_conversion_instead_of_the_gguf_metadata(default_model, monkeypatch):
    """Once the GGUF is converted, --explain reads the cached config and tokenizer: the same account, no parse."""
    cache, resolved = default_model
    monkeypatch.setenv(model_loading.CACHE_ENV_VAR, str(cache))

    def no_gguf_parse(*args, **kwargs):
        raise AssertionError("--explain parsed the GGUF although its conversion is cached")

    monkeypatch.setattr(model_loading, "gguf_architecture", no_gguf_parse)
    monkeypatch.setattr(GaudiLlamaForCausalLM, "from_pretrained", no_gguf_parse)
    text = explain(parse(["--explain", "--use_flash_attention"]))
    assert f"converted earlier, cached at {resolved.path}" in text
    assert "GaudiLlamaForCausalLM, 30 attention layers" in text


def test_explain_on_a_soft_capping_family_names_the_fallback(tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "gemma2", model_type="gemma2")
    argv = [
        "--model_name_or_path",
        str(checkpoint),
        "--use_flash_attention",
        "--batch_size",
        "2",
        "--max_new_tokens",
        "4",
    ]
    text = explain(parse(argv))
    assert "soft-capped logits" in text and "fused kernel," not in text.split("Flags:")[0]


def explained_key_lengths(text: str) -> dict[tuple[int, str], str]:
    """--explain's key lengths per (layer, phase), from its phase line or, where its groups differ, each group's."""
    lengths, phase, shared = {}, None, None
    for line in text.split("Attention calls:")[1].split("Graphs:")[0].splitlines():
        if heading := re.match(r"  (prefill|decode)[^(]*\(q=\d+(?:, kv=([\d.]+))?", line):
            phase, shared = heading.groups()
        elif group := re.match(r"    layers? ([\d,\-]+)(?: \(.*?\))?: (?:kv=([\d.]+): )?", line):
            for part in group.group(1).split(","):
                first, _, last = part.partition("-")
                for layer in range(int(first), int(last or first) + 1):
                    lengths[layer, phase] = group.group(2) or shared
    return lengths


def record_key_lengths(monkeypatch) -> dict[tuple[object, str], list[int]]:
    """Every attention call's key length from now on, by the module's `layer_idx` and the phase, as transformers'
    attention interface hands the call on (whichever attention the run uses)."""
    from transformers import AttentionInterface

    seen = {}
    for name, attention_function in list(AttentionInterface._global_mapping.items()):

        def recorded(module, query, key, *args, attend=attention_function, **kwargs):
            phase = "prefill" if query.shape[2] > 1 else "decode"
            seen.setdefault((module.layer_idx, phase), []).append(key.shape[2])
            return attend(module, query, key, *args, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, name, recorded)
    return seen


def key_range(lengths: list[int]) -> str:
    """Key lengths as --explain writes them: one number, or the fewest..the most."""
    return f"{min(lengths)}..{max(lengths)}" if min(lengths) < max(lengths) else str(lengths[0])


@pytest.mark.parametrize(
    "extra", [[], ["--static_shapes"], ["--bucket_size", "8"]], ids=["dynamic", "static", "buckets"]
)
def test_explain_says_how_many_keys_each_layer_reads(script, tmp_path, monkeypatch, extra):
    """gpt-oss alternates windows of 8 with full layers: its windowed layers read 8 keys a decode step, its full ones
    the filled slots (generate()'s static cache is bucketed over them, and holds prompt + new tokens - 1). The
    account once gave every layer the cache's whole length, whatever the layer and the cache."""
    checkpoint = save_tiny_checkpoint(tmp_path / "gpt_oss", model_type="gpt_oss")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "sliding_window": 8}))
    argv = tiny_argv(checkpoint, "--use_flash_attention", "--max_new_tokens", "12", *extra)
    explained = explained_key_lengths(explain(parse(argv)))
    seen = record_key_lengths(monkeypatch)
    run_in_process(script, argv, tmp_path / "run")
    real = {key: key_range(lengths) for key, lengths in seen.items()}
    assert real == explained
    assert real[0, "decode"] == "8" and real[1, "decode"] != "8"


@pytest.mark.parametrize("extra", [[], ["--static_shapes"]], ids=["dynamic", "static"])
def test_explain_counts_the_keys_of_shared_attention_blocks(script, tmp_path, monkeypatch, extra):
    """Zamba 2's attention is one shared block (its modules' `layer_idx` is -1, no cache layer of its own): --explain
    numbered its layers -1 and read the keys off the cache's last layer. Its layers keep their order's numbers, and
    every call reads what the account says: the sequence, or a static cache's whole length."""
    from tests.families.support import save_family_checkpoint
    from tests.helpers import train_tiny_tokenizer

    checkpoint = save_family_checkpoint(tmp_path, "zamba2", train_tiny_tokenizer(chat_template=True))
    argv = ["--model_name_or_path", str(checkpoint), "--use_flash_attention", "--max_new_tokens", "6", *extra]
    argv += ["--batch_size", "2", "--n_iterations", "1", "--warmup", "0"]
    explained = explained_key_lengths(explain(parse(argv)))
    assert {layer for layer, _ in explained} == {0, 1}
    seen = record_key_lengths(monkeypatch)
    run_in_process(script, argv, tmp_path / "run")
    assert {index for index, _ in seen} == {-1}  # one shared block: no layer number of its own
    for phase in ("prefill", "decode"):
        said = {explained[layer, phase] for layer in (0, 1)}
        assert said == {key_range(seen[-1, phase])}, (phase, said)


def test_explain_counts_deepseek_v4s_compressed_blocks(script, tmp_path, monkeypatch):
    """DeepSeek V4's compressed layers attend over their window's keys and one more key per `compress_rate` tokens
    seen (here 4 in its sparse layer, 128 in the others): --explain counted the window's alone (34 where the prompt's
    calls read 42)."""
    from tests.families.support import save_family_checkpoint
    from tests.helpers import train_tiny_tokenizer

    checkpoint = save_family_checkpoint(tmp_path, "deepseek_v4", train_tiny_tokenizer(chat_template=True))
    argv = ["--model_name_or_path", str(checkpoint), "--use_flash_attention", "--max_new_tokens", "6"]
    argv += ["--batch_size", "2", "--n_iterations", "1", "--warmup", "0"]
    explained = explained_key_lengths(explain(parse(argv)))
    seen = record_key_lengths(monkeypatch)
    run_in_process(script, argv, tmp_path / "run")
    real = {key: key_range(lengths) for key, lengths in seen.items()}
    assert real == explained
    assert real[2, "prefill"] != real[0, "prefill"]  # the sparse layer's blocks: more keys than the prompt's


def test_explain_on_gaudi_names_the_cache_generate_builds_there():
    """On Gaudi generate() builds a bucketed static cache of prompt + new tokens - 1 slots, windows at the whole
    length; DeepSeek V4, which transformers builds no static cache for, keeps the dynamic one (`generation_cache`)."""
    from transformers import DynamicCache

    from optimum.habana.cli.generation.explain.keys import run_cache
    from optimum.habana.cli.generation.generation_config import CacheLayout
    from optimum.habana.transformers.models import gaudi_model_class
    from tests.families.tiny_configs import tiny_family_config

    gaudi = torch.device("hpu")
    cache, words = run_cache(CacheLayout("dynamic"), tiny_config("mistral"), 51, gaudi, compiled=False)
    assert isinstance(cache, BucketedStaticCache) and (cache.bucket_size, cache.max_cache_len) == (256, 50)
    assert {type(layer).__name__ for layer in cache.layers} == {"BucketedStaticLayer"}  # the window's layers too
    assert words.startswith("dynamic asked, static on Gaudi: 50 slots") and "every window at the whole length" in words
    config = tiny_family_config("deepseek_v4", gaudi_model_class("deepseek_v4").config_class)
    cache, words = run_cache(CacheLayout("dynamic"), config, 51, gaudi, compiled=False)
    assert type(cache) is DynamicCache
    assert words.startswith("dynamic: grows by one token per step; on Gaudi too, as transformers has no static KV")


def test_explain_and_the_run_refuse_a_static_cache_transformers_cannot_build(script, tmp_path, capsys):
    """DeepSeek V4's compressed layers have no static cache layer: --static_shapes failed with a KeyError from inside
    transformers after the model loaded; both say so in one line, naming the flag."""
    from tests.families.support import save_family_checkpoint
    from tests.helpers import train_tiny_tokenizer

    checkpoint = save_family_checkpoint(tmp_path, "deepseek_v4", train_tiny_tokenizer(chat_template=True))
    argv = ["--model_name_or_path", str(checkpoint), "--max_new_tokens", "2", "--static_shapes"]
    message = (
        "--static_shapes: a static KV cache is needed, and transformers has no static KV cache for deepseek_v4 models "
        "(no static layer for their 'compressed_sparse_attention', 'heavily_compressed_attention' layers). Run "
        "without --static_shapes."
    )
    with pytest.raises(ValueError) as refused:
        explain(parse(argv))
    assert str(refused.value) == message
    with pytest.raises(SystemExit) as exit_info:
        script.main([*argv, "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "results.json").exists()


def test_explain_refuses_what_a_real_run_refuses(script, tiny_checkpoint, tmp_path, capsys):
    """Every bad model, adapter or prompt input of the run's table, plus a model folder given as the adapter and a
    truncated .gguf: --explain exits 2 with the real run's message, and explains a good adapter."""
    cases = bad_model_inputs(tiny_checkpoint, tmp_path)
    cases["model folder as adapter"] = (
        ["--model_name_or_path", str(tiny_checkpoint), "--peft_model", str(tiny_checkpoint)],
        "has no adapter_config.json, so it holds no PEFT adapter",
    )
    truncated = write_gguf(tmp_path / "cut.gguf", "llama")
    os.truncate(truncated, truncated.stat().st_size - 64)
    cases["truncated gguf"] = (["--model_name_or_path", str(truncated)], "cut.gguf' is not a valid GGUF file")
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "results.json").write_text("{}")
    cases["non-empty output_dir"] = (
        ["--model_name_or_path", str(tiny_checkpoint), "--output_dir", str(earlier)],
        "is not empty (results.json): refusing to overwrite an earlier run. Pass --overwrite_output_dir to replace "
        "its files, or another --output_dir.",  # no --resume_from_checkpoint here: the script has none
    )
    cases["output_dir is a file"] = (
        ["--model_name_or_path", str(tiny_checkpoint), "--output_dir", str(earlier / "results.json")],
        "is a file, not a folder",
    )
    for name, (argv, message) in cases.items():
        for extra in ([], ["--explain"]):
            with pytest.raises(SystemExit) as exit_info:
                script.main([*argv, *extra])
            stderr = capsys.readouterr().err
            assert exit_info.value.code == 2, (name, extra)
            assert message in stderr and "Traceback" not in stderr, (name, extra, stderr)

    adapter = tmp_path / "good_adapter"
    model = GaudiLlamaForCausalLM.from_pretrained(tiny_checkpoint)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(adapter)
    text = explain_text(tiny_checkpoint, "--peft_model", str(adapter))
    assert f"Adapter: {adapter} (LORA, fits the model), merged into the weights" in text
    assert (earlier / "results.json").read_text() == "{}"
    assert script.main(tiny_argv(tiny_checkpoint, "--explain", "--output_dir", str(tmp_path / "new" / "results"))) == 0
    assert not (tmp_path / "new").exists()  # --explain writes nothing, not even the folder


def test_explain_exits_before_loading(script, tiny_checkpoint, capsys):
    assert script.main(tiny_argv(tiny_checkpoint, "--explain", "--use_flash_attention")) == 0
    out = capsys.readouterr().out
    assert out.startswith("Explain") and "Stats:" not in out
    json.dumps(out)  # plain text


def test_explain_says_whether_each_phase_runs_as_one_graph(tiny_checkpoint):
    eager = explain_text(tiny_checkpoint, "--use_flash_attention")
    assert "eager: nothing is captured" in eager
    compiled = explain_text(tiny_checkpoint, "--use_flash_attention", "--torch_compile")
    assert "prompt: one graph (torch.compile, inductor)" in compiled
    assert "decode step: one graph (torch.compile, inductor)" in compiled


def test_explain_says_what_really_runs_here(tiny_checkpoint):
    """No HPU graph off Gaudi (with --limit_hpu_graphs too), no compiled decode step under beam search."""
    for extra in ([], ["--limit_hpu_graphs"]):
        text = explain_text(tiny_checkpoint, "--use_hpu_graphs", *extra)
        assert "eager: nothing is captured (--use_hpu_graphs: HPU graphs exist on Gaudi only, not on cpu" in text
        assert "an HPU graph" not in text
    beams = explain_text(tiny_checkpoint, "--torch_compile", "--torch_compile_backend", "eager", "--num_beams", "2")
    assert "prompt: one graph (torch.compile, eager)" in beams
    assert "decode step: runs eagerly (--num_beams 2: generate() compiles the decode step of greedy search" in beams


@pytest.mark.parametrize("masks_from_config", [True, False], ids=["family's masks", "config's masks"])
def test_explain_plans_a_static_cache_prompt_in_the_causal_mask_mode_where_generate_hands_the_2d_mask_on(
    masks_from_config,
):
    """On Gaudi in the causal-mask mode generate() hands a static cache's padded prompt its 2-D mask (the decoder
    plans valid lengths; a windowed layer longer than its window keeps the mask), unless the config's masks are not
    the family's (tests/core/test_hpu_kernel.py runs it): --explain says the same."""
    from optimum.habana.cli.generation.explain.calls import Phase, call_account
    from optimum.habana.cli.generation.explain.layers import LayerGroup
    from optimum.habana.transformers.attention_flags import AttentionFlags

    flags = AttentionFlags(use_flash_attention=True, flash_attention_causal_mask=True)
    prompt = Phase("prefill", 12, (20, 20), padded=True, from_empty_cache=True)  # a static cache of 20 slots
    full, windowed = (LayerGroup((0,), window, None, 0.25, geometry=(4, 2, 16, 16, False)) for window in (None, 8))
    device = torch.device("hpu")
    accounts = [
        call_account(flags, group, prompt, device, False, lambda *args, **kwargs: "FusedSDPA", masks_from_config)
        for group in (full, windowed)
    ]
    if masks_from_config:
        assert "attn_mask=None, is_causal=True, valid lengths per row" in accounts[0]
        assert "(sliding window 8 < prompt: the mask keeps it; one warning)" in accounts[1]
    else:
        assert all("attn_mask=boolean [rows, 1, 12, kv] (additive), is_causal=False" in line for line in accounts)
