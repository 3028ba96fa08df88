"""The Gaudi classes behave like the stock classes wherever a transformers user would notice.

Each test here is one of the ways the first `GaudiLlamaForCausalLM` was not a drop-in (issue 7), plus the
attention-function contract that keeps family features from being dropped.
"""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from optimum.habana import GaudiLlamaForCausalLM, adapt_transformers_to_gaudi, gaudi_attention_forward
from optimum.habana.kernels import dispatch
from tests.helpers import FUSED_KERNEL_CPU, count_attention_paths, left_padded_batch, tiny_llama_config


LAYERS = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(folder)
    return folder


@pytest.fixture
def inputs():
    return left_padded_batch([9, 6], seed=1)


def test_output_loading_info_returns_the_model_and_the_info(checkpoint):
    model, info = GaudiLlamaForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
    assert isinstance(model, GaudiLlamaForCausalLM)
    assert info["missing_keys"] == set() or info["missing_keys"] == []
    assert model.generation_config.__class__.__name__ == "GaudiGenerationConfig"


@pytest.mark.parametrize("saved_flags", [False, True], ids=["stock checkpoint", "flags saved"])
def test_generation_settings_given_to_from_pretrained_reach_the_generation_config(checkpoint, tmp_path, saved_flags):
    """Stock applies from_pretrained's generation settings to the generation config it loads (a model that ends
    at another token); the Gaudi class read the file again without them. Saved flags survive as well."""
    if saved_flags:
        model = GaudiLlamaForCausalLM.from_pretrained(checkpoint)
        model.generation_config.use_flash_attention = True
        model.save_pretrained(tmp_path)
        checkpoint = tmp_path
    settings = {"eos_token_id": 30, "pad_token_id": 5, "bos_token_id": 9, "output_hidden_states": True}
    stock = LlamaForCausalLM.from_pretrained(checkpoint, **settings)
    ours = GaudiLlamaForCausalLM.from_pretrained(checkpoint, **settings)
    for name, value in settings.items():
        assert getattr(ours.generation_config, name) == getattr(stock.generation_config, name) == value, name
    assert ours.generation_config.use_flash_attention is (True if saved_flags else None)


BUILDERS = {
    "from_pretrained": lambda checkpoint, name: GaudiLlamaForCausalLM.from_pretrained(
        checkpoint, attn_implementation=name
    ),
    "_from_config": lambda checkpoint, name: GaudiLlamaForCausalLM._from_config(
        tiny_llama_config(), attn_implementation=name
    ),
    "constructor config": lambda checkpoint, name: GaudiLlamaForCausalLM(tiny_llama_config(attn_implementation=name)),
    "set_attn_implementation": lambda checkpoint, name: set_after_build(name),
}


def set_after_build(name):
    model = GaudiLlamaForCausalLM(tiny_llama_config())
    model.set_attn_implementation(name)
    return model


@pytest.mark.parametrize("route", BUILDERS)
@pytest.mark.parametrize(
    "name, fused", [("eager", False), ("sdpa", True), ("gaudi_fused_sdpa", True), ("gaudi", False)]
)
def test_attn_implementation_maps_onto_the_two_paths_by_every_route(
    checkpoint, inputs, route, name, fused, monkeypatch
):
    model = BUILDERS[route](checkpoint, name).eval()
    # What the user asked for stays visible, where transformers' own checks read it.
    assert model.config._attn_implementation == name
    with count_attention_paths(monkeypatch) as counts:
        model(**inputs)
    assert counts["fused" if fused else "default"] == LAYERS
    assert counts["default" if fused else "fused"] == 0
    # The per-call flag still decides for one call.
    with count_attention_paths(monkeypatch) as counts:
        model(**inputs, use_flash_attention=not fused)
    assert counts["default" if fused else "fused"] == LAYERS


@pytest.mark.parametrize("route", BUILDERS)
@pytest.mark.parametrize("name", ["flash_attention_2", "flex_attention", "bogus"])
def test_other_attn_implementations_are_one_clear_error(checkpoint, route, name):
    # transformers' own words (its callers and tests match them), then the names the Gaudi attention takes.
    message = (
        rf'Specified `attn_implementation="{name}"` is not supported by GaudiLlamaForCausalLM.*\'gaudi_fused_sdpa\''
    )
    with pytest.raises(ValueError, match=message):
        BUILDERS[route](checkpoint, name)


def test_output_attentions_at_load_gives_weights_even_with_the_flag(checkpoint, inputs, monkeypatch):
    model = GaudiLlamaForCausalLM.from_pretrained(checkpoint, output_attentions=True)
    assert model.config._attn_implementation == "eager"
    dispatch.warn_once.cache_clear()
    expected = "output_attentions=True asks for the attention weights"
    with pytest.warns(UserWarning, match=expected) as record, count_attention_paths(monkeypatch) as counts:
        first = model(**inputs, use_flash_attention=True)
        model(**inputs, use_flash_attention=True)
    assert len([w for w in record if "output_attentions" in str(w.message)]) == 1
    assert counts["default"] == 2 * LAYERS and counts["fused"] == 0
    assert len(first.attentions) == LAYERS and first.attentions[0].shape == (2, 4, 9, 9)


def test_per_call_output_attentions_runs_that_call_on_the_default_path(inputs, monkeypatch):
    torch.manual_seed(0)
    model = GaudiLlamaForCausalLM(tiny_llama_config()).eval()
    with count_attention_paths(monkeypatch) as counts:
        output = model(**inputs, use_flash_attention=True, output_attentions=True)
        model(**inputs, use_flash_attention=True)
    assert counts["default"] == LAYERS and counts["fused"] == LAYERS
    assert len(output.attentions) == LAYERS and output.attentions[0].shape == (2, 4, 9, 9)


def test_generate_dict_outputs_and_assisted_decoding_run_with_the_flag(inputs):
    torch.manual_seed(0)
    model = GaudiLlamaForCausalLM(tiny_llama_config(initializer_range=0.1)).eval()
    assistant = GaudiLlamaForCausalLM(tiny_llama_config(num_hidden_layers=1)).eval()
    greedy = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    reference = model.generate(**inputs, **greedy)

    out = model.generate(
        **inputs, **greedy, use_flash_attention=True, output_attentions=True, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, reference)
    assert len(out.attentions) == 5 and len(out.attentions[0]) == LAYERS

    single = {name: tensor[1:, 3:] for name, tensor in inputs.items()}  # assisted decoding takes batch 1
    assisted = model.generate(**single, **greedy, assistant_model=assistant, use_flash_attention=True)
    assert torch.equal(assisted, model.generate(**single, **greedy))


def test_building_a_gaudi_model_leaves_the_callers_config_alone(inputs, monkeypatch):
    config = tiny_llama_config()
    GaudiLlamaForCausalLM(config)
    assert config._attn_implementation is None
    stock = LlamaForCausalLM(config).eval()
    assert stock.config._attn_implementation == "sdpa"
    with count_attention_paths(monkeypatch) as counts:
        stock(**inputs)
    assert counts["fused"] == counts["default"] == 0


def test_from_config_leaves_the_callers_config_alone_too():
    """transformers' `_from_config` writes the dtype and the attention choice into the config it is given (stock's
    does): a Gaudi model's works on a copy, as its constructor does."""
    config = tiny_llama_config()
    GaudiLlamaForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.bfloat16)
    assert config._attn_implementation is None and config.dtype is None


@pytest.mark.parametrize(
    "rebuild",
    [
        lambda config: GaudiLlamaForCausalLM(config),
        lambda config: GaudiLlamaForCausalLM._from_config(config),
        lambda config: AutoModelForCausalLM.from_config(config),  # after adapt_transformers_to_gaudi()
    ],
    ids=["constructor", "_from_config", "AutoModelForCausalLM.from_config"],
)
def test_a_model_built_from_a_built_models_config_is_built_the_same_way(rebuild):
    """A build with nothing chosen fills in stock's name ("sdpa"), which, chosen by a user, turns the flag on: the
    next model built from that config (a reference model, a model_init) once ran the fused kernel where the first
    ran the default path. A choice made on the model, or given to the rebuild, still counts."""
    adapt_transformers_to_gaudi()
    first = GaudiLlamaForCausalLM(tiny_llama_config())
    again = rebuild(first.config)
    assert type(again) is GaudiLlamaForCausalLM and again.config._attn_implementation == "sdpa"
    assert again.generation_config.use_flash_attention is first.generation_config.use_flash_attention is None
    first.set_attn_implementation("sdpa")  # chosen now: the flag follows it, and so does a rebuild
    assert rebuild(first.config).generation_config.use_flash_attention is True
    chosen = GaudiLlamaForCausalLM._from_config(
        GaudiLlamaForCausalLM(tiny_llama_config()).config, attn_implementation="sdpa"
    )
    assert chosen.generation_config.use_flash_attention is True


def test_flag_values_are_checked_when_reached_through_the_registration_alone(inputs):
    """A stock class with attn_implementation="gaudi" has no Gaudi forward: the attention checks the values."""
    model = LlamaForCausalLM(tiny_llama_config(attn_implementation="gaudi")).eval()
    with pytest.raises(ValueError, match=r"`use_flash_attention` must be True or False, got 'False'"):
        model(**inputs, use_flash_attention="False")
    with pytest.raises(ValueError, match="`flash_attention_recompute` requires `use_flash_attention`"):
        model(**inputs, flash_attention_recompute=True)


def test_an_attention_keyword_nobody_handles_is_an_error():
    query = key = value = torch.zeros(1, 2, 3, 4)
    module = torch.nn.Linear(1, 1)
    with pytest.raises(TypeError, match=r"does not know the argument\(s\) \['block_indices'\] that Linear passes"):
        gaudi_attention_forward(module, query, key, value, None, block_indices=torch.zeros(2))


def test_the_core_needs_none_of_the_example_dependencies():
    """What `pip install .` without extras gives: the library imports, builds a model and generates with the flag."""
    code = """
import sys
for name in ("datasets", "peft", "tabulate", "matplotlib", "lm_eval"):
    sys.modules[name] = None  # importing any of them now fails
import torch
from transformers import AutoConfig
import optimum.habana
from optimum.habana.utils import devices, model_loading, pretrained  # the core helpers too
config = AutoConfig.for_model("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1)
model = optimum.habana.gaudi_model_class("qwen2")(config).eval()
ids = torch.randint(3, 64, (1, 6))
out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, use_flash_attention=True)
assert out.shape == (1, 9)
assert "optimum.habana.cli" not in sys.modules
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_adapt_transformers_to_gaudi_registers_every_family():
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from optimum.habana import adapt_transformers_to_gaudi, gaudi_model_class, supported_model_types
    from tests.families.tiny_configs import tiny_family_config

    adapt_transformers_to_gaudi()
    for model_type in supported_model_types():
        gaudi_class = gaudi_model_class(model_type)
        # the model type's own config (a checkpoint's): `llama4` has the composite one, `internlm3` its own
        for config_class in (CONFIG_MAPPING[model_type], gaudi_class.config_class):
            assert AutoModelForCausalLM._model_mapping[config_class] is gaudi_class, (model_type, config_class)
    # Built through the Auto class: a written family, and one of each variant made from transformers' class.
    for model_type in ("llama", "gpt_oss", "deepseek_v3", "qwen3_next", "gemma4_text"):
        config_class = gaudi_model_class(model_type).config_class
        model = AutoModelForCausalLM.from_config(tiny_family_config(model_type, config_class))
        assert type(model) is gaudi_model_class(model_type)
    # A published Llama 4 checkpoint's config is the composite one: its causal LM is the text model's Gaudi class.
    text = tiny_family_config("llama4_text", gaudi_model_class("llama4").config_class)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["llama4"](text_config=text.to_dict()))
    assert type(model) is gaudi_model_class("llama4_text")


def test_a_gaudi_model_survives_a_deep_copy(inputs, monkeypatch):
    import copy

    torch.manual_seed(0)
    model = GaudiLlamaForCausalLM(tiny_llama_config()).eval()
    clone = copy.deepcopy(model)
    clone.config.sliding_window = 1234  # a later change of the copy's config reaches the copy's layers only
    assert clone.model.layers[0].self_attn.config.sliding_window == 1234
    assert getattr(model.model.layers[0].self_attn.config, "sliding_window", None) != 1234
    with count_attention_paths(monkeypatch) as counts:
        clone(**inputs, use_flash_attention=True)
    assert counts["fused"] == counts[FUSED_KERNEL_CPU] == LAYERS


def test_a_subclass_that_writes_its_own_forward_keeps_it(inputs, monkeypatch):
    """As over the stock class: the override runs, and its super().forward() is the Gaudi one, flags and all."""

    class Scaled(GaudiLlamaForCausalLM):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.logits = output.logits * 2
            return output

    torch.manual_seed(0)
    model = Scaled(tiny_llama_config()).eval()
    plain = GaudiLlamaForCausalLM(tiny_llama_config()).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad(), count_attention_paths(monkeypatch) as counts:
        scaled = model(**inputs, use_flash_attention=True).logits
    assert counts["fused"] == LAYERS and counts["default"] == 0
    with torch.no_grad():
        torch.testing.assert_close(scaled, 2 * plain(**inputs, use_flash_attention=True).logits)


@pytest.mark.parametrize("wrapped", [False, True], ids=["model", "under PEFT"])
def test_trainers_label_smoothing_shifts_the_labels_as_for_the_stock_class(tmp_path, wrapped):
    """transformers' Trainer shifts the labels of its label smoothing only for a class it finds by name among the
    causal LMs: a Gaudi class was trained to predict the current token. Its repr still names the Gaudi class."""
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    stock = LlamaForCausalLM(tiny_llama_config()).eval()
    ours = GaudiLlamaForCausalLM(tiny_llama_config()).eval()
    ours.load_state_dict(stock.state_dict())
    assert repr(ours).startswith("GaudiLlamaForCausalLM(")
    inputs = left_padded_batch([9, 6], seed=1)
    inputs["labels"] = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    arguments = TrainingArguments(tmp_path, label_smoothing_factor=0.1, report_to=[], use_cpu=True)
    losses = []
    for model in (stock, ours):
        if wrapped:
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=True))
        losses.append(Trainer(model=model, args=arguments).compute_loss(model, dict(inputs)).detach())
    torch.testing.assert_close(losses[1], losses[0])


def test_a_push_to_the_hub_uploads_config_json_naming_the_stock_class(tmp_path, monkeypatch):
    """save_pretrained(push_to_hub=True) goes through push_to_hub, which saves through the Gaudi class's save (the
    Hub is out of reach here: the upload is recorded)."""
    uploaded = {}

    def upload(self, save_directory, repo_id, files_timestamps, **kwargs):
        uploaded["config"] = json.loads((Path(save_directory) / "config.json").read_text())
        uploaded["repo_id"] = repo_id

    monkeypatch.setattr(GaudiLlamaForCausalLM, "_upload_modified_files", upload)
    hub_api = types.SimpleNamespace(create_repo=lambda repo_id, **kwargs: types.SimpleNamespace(repo_id=repo_id))
    monkeypatch.setattr("transformers.utils.hub.hf_api", lambda: hub_api)
    monkeypatch.setattr("transformers.utils.hub.create_and_tag_model_card", lambda *args, **kwargs: ModelCard(""))
    model = GaudiLlamaForCausalLM(tiny_llama_config())
    model.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id="someone/tiny")
    assert json.loads((tmp_path / "local" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert uploaded["repo_id"] == "someone/tiny" and uploaded["config"]["architectures"] == ["LlamaForCausalLM"]
