"""The classes made from transformers' own are drop-ins as the written ones are: they pickle (a fresh process finds
them by name), save and load, and `adapt_transformers_to_gaudi()` hands them out through the Auto classes."""

import inspect
import json
import pickle
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum.habana import adapt_transformers_to_gaudi, gaudi_model_class
from optimum.habana.transformers.families.qualification import causal_lm_model_types
from optimum.habana.transformers.models import family_table
from tests.families.support import LENGTHS, family_pair
from tests.helpers import ROOT, in_make_test, left_padded_batch


def test_a_made_class_pickles_and_a_fresh_process_finds_it(tmp_path):
    ours, _ = family_pair("gpt_oss")
    assert type(ours).__module__ == "optimum.habana.transformers.models.generated"
    inputs = left_padded_batch(LENGTHS)
    with torch.no_grad():
        expected = ours(**inputs, use_flash_attention=True).logits
    copy = pickle.loads(pickle.dumps(ours))
    assert type(copy) is type(ours)
    with torch.no_grad():
        assert torch.equal(copy(**inputs, use_flash_attention=True).logits, expected)
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(ours))
    code = (
        f"import pickle; model = pickle.load(open({str(tmp_path / 'model.pkl')!r}, 'rb')); print(type(model).__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "GaudiGptOssForCausalLM"


def test_a_made_class_saves_loads_and_comes_from_the_auto_class(tmp_path):
    ours, _ = family_pair("deepseek_v3")
    ours.generation_config.use_flash_attention = True
    ours.save_pretrained(tmp_path)
    loaded = gaudi_model_class("deepseek_v3").from_pretrained(tmp_path)
    assert loaded.generation_config.use_flash_attention is True
    adapt_transformers_to_gaudi()
    auto = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(auto) is gaudi_model_class("deepseek_v3")
    inputs = left_padded_batch(LENGTHS)
    with torch.no_grad():
        assert torch.equal(auto(**inputs).logits, ours(**inputs).logits)


def qualifying_families() -> list[str]:
    """Each qualifying model type with a Gaudi class of its own (`llama4` runs `llama4_text`'s)."""
    table = family_table()
    return [
        model_type
        for model_type in causal_lm_model_types()
        if table[model_type].qualifies and gaudi_model_class(model_type).config_class.model_type == model_type
    ]


# Families whose checkpoints transformers converts by class name (GPT-NeoX's `embed_out`), by model type
# (DeepSeek V4's `embed`), or initialises past the checkpoint (Falcon-H1's `mup_vector` buffer); the rest run in
# `make test-families`.
CONVERTED = {"gpt_neox", "deepseek_v4", "falcon_h1"}


@pytest.mark.parametrize("model_type", in_make_test(qualifying_families(), CONVERTED))
def test_checkpoints_cross_between_the_stock_class_and_ours(model_type, tmp_path):
    """A stock checkpoint loads into the Gaudi class and a Gaudi one into the stock class: every key where stock puts
    it, config.json naming the stock class, and the same logits. transformers treated the Gaudi classes as custom code, which skips the checkpoint's key
    conversions and the initialisation of what it lacks."""
    ours, stock = family_pair(model_type)
    inputs = left_padded_batch(LENGTHS)
    for saved, reference, folder in ((stock, ours, "stock"), (ours, stock, "ours")):
        saved.save_pretrained(tmp_path / folder)
        # the stock class by name, as tools that build it from config.json read it (`transformers serve`)
        assert json.loads((tmp_path / folder / "config.json").read_text())["architectures"] == [type(stock).__name__]
        loaded, info = type(reference).from_pretrained(
            tmp_path / folder, attn_implementation="eager", output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        real = inputs["attention_mask"].bool()  # padding positions follow each model's attention (eager's: average)
        with torch.no_grad():  # the same weights as the model of that class in memory: the same logits
            found, expected = loaded.eval()(**inputs).logits, reference(**inputs).logits
            torch.testing.assert_close(found[real], expected[real], msg=folder)


def test_every_gaudi_forward_has_its_stock_class_signature():
    """Positional arguments bind as for the stock class (GPT-2 takes `past_key_values` second, the MoE families
    `output_router_logits` eighth), and transformers reads the stock inputs off it (generate's `token_type_ids`)."""
    for model_type in qualifying_families():
        gaudi_class = gaudi_model_class(model_type)
        stock_class = next(cls for cls in gaudi_class.__mro__ if cls.__module__.startswith("transformers."))
        assert inspect.signature(gaudi_class.forward) == inspect.signature(stock_class.forward), model_type


@pytest.mark.parametrize("model_type", ["gpt2", "recurrent_gemma", "mixtral"])
def test_positional_arguments_bind_as_for_the_stock_class(model_type):
    ours, stock = family_pair(model_type)
    inputs = left_padded_batch(LENGTHS)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    names = list(inspect.signature(stock.forward).parameters)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    by_name = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids, "use_cache": True}
    args = [by_name.get(name) for name in names[: max(names.index(name) for name in by_name) + 1]]
    if model_type == "mixtral":  # the eighth: output_router_logits, where the generic order had logits_to_keep
        args += [None] * (names.index("output_router_logits") - len(args)) + [True]
    real = mask.bool()
    with torch.no_grad():
        expected = stock(*args)
        for flag in (False, True):
            output = ours(*args, use_flash_attention=flag)
            assert (output.logits[real] - expected.logits[real]).abs().max() <= 1e-4, (model_type, flag)
            if model_type == "mixtral":
                assert len(output.router_logits) == len(expected.router_logits) > 0
    with pytest.raises(TypeError, match="forward\\(\\) got multiple values for argument 'input_ids'"):
        ours(ids, input_ids=ids)


def test_generate_takes_the_stock_forwards_token_type_ids():
    ours, stock = family_pair("gpt2")
    inputs = left_padded_batch(LENGTHS)
    token_type_ids = torch.ones_like(inputs["input_ids"])
    settings = {"max_new_tokens": 4, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    expected = stock.generate(**inputs, token_type_ids=token_type_ids, **settings)
    for flag in (False, True):
        output = ours.generate(**inputs, token_type_ids=token_type_ids, use_flash_attention=flag, **settings)
        assert torch.equal(output.sequences, expected.sequences)
        for step, logits in enumerate(output.logits):
            assert (logits - expected.logits[step]).abs().max() <= 1e-4, (flag, step)
