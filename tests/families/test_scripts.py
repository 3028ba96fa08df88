"""The example scripts and the server on saved tiny checkpoints of the new variants: a hybrid, a latent-attention, a
sink and a per-layer-geometry family, each with the flag reaching every attention call and the default path's
results. `make test` runs each script on one of them and each of them through one script; the whole matrix runs
under the `families` marker (`make test-families`)."""

import pytest
import torch

from optimum.habana import gaudi_model_class, supported_model_types
from tests.families.support import save_family_checkpoint
from tests.finetuning.support import TOLERANCE, build_tokenizer, run_script, script_args
from tests.generation.support import outputs, run_in_process
from tests.helpers import (
    count_attention_paths,
    in_make_test,
    load_script,
    record_absorbed_rows,
    train_tiny_tokenizer,
)


VARIANT_FAMILIES = {
    "qwen3_next": "hybrid",
    "deepseek_v3": "latent attention",
    "gpt_oss": "attention sinks",
    "gemma4_text": "per-layer geometry",
}
SCRIPTS = ("run_generation", "run_lora_clm", "run_lm_eval", "serve")
DIAGONAL = set(zip(SCRIPTS, VARIANT_FAMILIES, strict=True))
CASES = [
    pytest.param(script, model_type, marks=() if (script, model_type) in DIAGONAL else pytest.mark.families)
    for script in SCRIPTS
    for model_type in VARIANT_FAMILIES
]


def run_generation(model_type: str, folder) -> None:
    script = load_script("examples/text-generation/run_generation.py")
    checkpoint = save_family_checkpoint(folder / "checkpoint", model_type, train_tiny_tokenizer(chat_template=True))
    argv = ["--model_name_or_path", str(checkpoint), "--batch_size", "2", "--max_new_tokens", "4"]
    argv += ["--warmup", "0", "--n_iterations", "1"]
    default = run_in_process(script, argv, folder / "default")
    with pytest.MonkeyPatch.context() as patch, count_attention_paths(patch, profile=False) as counts:
        flash = run_in_process(script, [*argv, "--use_flash_attention"], folder / "flash")
    assert outputs(flash) == outputs(default) and all(outputs(flash))
    assert counts["fused"] > 0 and counts["default"] == 0


def run_lora_clm(model_type: str, folder) -> None:
    script = load_script("examples/language-modeling/run_lora_clm.py")
    checkpoint = save_family_checkpoint(folder / "checkpoint", model_type, build_tokenizer())
    common = "--do_train --max_steps 2 --per_device_train_batch_size 2 --logging_steps 1 --lora_dropout 0"
    runs = {
        flag: run_script(
            script, script_args(checkpoint, folder / flag, *common.split(), "--use_flash_attention", flag), False
        )
        for flag in ("False", "True")
    }
    assert runs["True"].counts["fused"] > 0 and runs["True"].counts["default"] == 0
    for default, flash in zip(runs["False"].losses, runs["True"].losses, strict=True):
        assert abs(default - flash) <= TOLERANCE


def run_lm_eval(model_type: str, folder) -> None:
    from tests.evaluation.test_run_lm_eval import evaluate

    script = load_script("examples/text-generation/run_lm_eval.py")
    checkpoint = save_family_checkpoint(folder / "checkpoint", model_type, train_tiny_tokenizer(chat_template=False))
    argv = ["--tasks", "flash_mc", "-L", "2", "--model_name_or_path", str(checkpoint)]
    default, _ = evaluate(script, argv, folder / "default.json")
    flash, calls = evaluate(script, [*argv, "--use_flash_attention"], folder / "flash.json")
    assert flash["results"]["flash_mc"] == default["results"]["flash_mc"]
    assert calls and {path for path, _ in calls} == {"fused"}


def serve(model_type: str, folder) -> None:
    from tests.serving.servers import RunningServer

    checkpoint = save_family_checkpoint(folder / "checkpoint", model_type, train_tiny_tokenizer(chat_template=True))
    with pytest.MonkeyPatch.context() as patch, count_attention_paths(patch, profile=False) as counts:
        server = RunningServer(checkpoint, flags={"use_flash_attention": True})
        try:
            answer = server.chat("The quick brown fox")
        finally:
            server.stop()
    assert isinstance(answer, str)
    assert counts["fused"] > 0 and counts["default"] == 0


@pytest.mark.parametrize(("script", "model_type"), CASES)
def test_script_runs_the_family_fused(script, model_type, tmp_path):
    globals()[script](model_type, tmp_path)


EXPLAINED = {
    "qwen3_next": ["other layers: 2 linear_attention: no softmax attention, the flag leaves them to the model"],
    "deepseek_v3": ["latent attention: query/key heads of 24, value heads of 16"],
    "gpt_oss": [
        "(sliding window of 8 tokens; attention sinks: one more logit in each row's softmax)",
        "(attention sinks: one more logit in each row's softmax)",
    ],
    "gemma4_text": ["this layer's geometry: 4 heads of 16", "this layer's geometry: 4 heads of 32"],
}


@pytest.mark.parametrize(
    "model_type",
    # gpt-oss's calls take every transform (sinks, query groups as rows, padded values); the rest under `families`
    in_make_test(VARIANT_FAMILIES, kept={"gpt_oss"}),
)
def test_explain_names_each_layers_variant_and_the_kernel_path_of_each_call(model_type, tmp_path, monkeypatch):
    """--explain's account of a call is `fused_sdpa`'s own decision (`kernel_path`): every path a real run takes,
    with its transforms, appears in the phase's lines."""
    from optimum.habana.cli.generation.explain import explain
    from optimum.habana.kernels import dispatch
    from tests.generation.support import parse

    checkpoint = save_family_checkpoint(tmp_path, model_type, train_tiny_tokenizer(chat_template=True))
    argv = ["--model_name_or_path", str(checkpoint), "--use_flash_attention", "--max_new_tokens", "4"]
    text = explain(parse(argv))
    for words in EXPLAINED[model_type]:
        assert words in text
    decided = []

    def recorded(query, *args, **kwargs):
        decided.append((query.shape[2], dispatch.KernelPath(*kernel_path(query, *args, **kwargs))))
        return decided[-1][1]

    kernel_path = dispatch.kernel_path
    monkeypatch.setattr(dispatch, "kernel_path", recorded)
    absorbed = record_absorbed_rows(monkeypatch)  # latent attention's calls over its compressed cache
    run_in_process(
        load_script("examples/text-generation/run_generation.py"), [*argv, "--n_iterations", "1"], tmp_path / "run"
    )
    prefill, decode = text.split("Graphs:")[0].split("  decode")
    assert decided or absorbed
    for q_len, path in decided:
        assert f"fused kernel, {path.describe(torch.device('cpu'))}:" in (decode if q_len == 1 else prefill), path
    for q_len in absorbed:
        assert "over the compressed cache (kv_b_proj absorbed" in (decode if q_len == 1 else prefill)
    assert bool(absorbed) == (model_type == "deepseek_v3")


def test_explain_reads_the_layers_of_every_served_family():
    """--explain's account of the layers, on the meta device: GPT-2, OPT and GPT-NeoX name no key/value heads (a
    traceback, where a real run worked). One test in `make test` (about 15 s of CPU): `make test-families` is at its
    time budget."""
    from optimum.habana.cli.generation.explain import attention_layer_groups, meta_model
    from tests.families.tiny_configs import tiny_family_config

    for model_type in supported_model_types():
        model_class = gaudi_model_class(model_type)
        config = tiny_family_config(model_type, model_class.config_class)
        heads, kv_heads = attention_layer_groups(meta_model(model_class, config))[0].geometry[:2]
        assert heads % kv_heads == 0, model_type


@pytest.mark.parametrize("model_type", ["mistral", "exaone4", "gpt_oss", "gemma3_text", "inkling_text", "llama"])
def test_explain_reads_each_layers_window_as_its_call_hands_it(model_type, monkeypatch):
    """--explain read the window off the module: Mistral hands its window in the call only (explained as plain
    causal attention), Exaone 4's full layers hold one they do not hand on (explained as windowed)."""
    from transformers import AttentionInterface

    from optimum.habana.transformers import attention
    from optimum.habana.transformers.families.lookups import attention_modules_of, call_window
    from tests.families.tiny_configs import tiny_family_config

    model_class = gaudi_model_class(model_type)
    model = model_class(tiny_family_config(model_type, model_class.config_class)).eval()
    handed = {}

    def recorded(module, *args, **kwargs):
        handed.setdefault(module, kwargs.get("sliding_window"))
        return attention.gaudi_attention_forward(module, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "gaudi", recorded)
    with torch.no_grad():
        model(torch.randint(3, 50, (1, 12)))
    modules = attention_modules_of(model)
    assert [call_window(module, model.config) for module in modules] == [handed[module] for module in modules]
    if model_type in ("mistral", "exaone4"):
        assert len(set(handed.values())) == (1 if model_type == "mistral" else 2) and 8 in handed.values()
