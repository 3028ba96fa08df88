"""The kernel's names mean the kernel, on any class of a qualifying family, Gaudi or stock; and on a family that does
not qualify they refuse in one line, before a layer runs, instead of running the family's own attention."""

import pytest
import torch
import transformers

from optimum.habana.transformers.models import family_report, gaudi_model_class
from tests.families.support import LENGTHS, attention_calls_by_module, attention_modules
from tests.families.tiny_configs import tiny_family_config
from tests.helpers import count_attention_paths, left_padded_batch


# A plain family, a latent-attention family and a hybrid, built from transformers' own classes. (Sink families' stock
# classes refuse any name containing "sdpa" when they are built, transformers' own check: "gaudi" serves them.)
STOCK_FAMILIES = ("phi", "deepseek_v3", "qwen3_next")


def stock_pair(model_type: str, name: str):
    stock_class = getattr(transformers, family_report(model_type).class_name)
    torch.manual_seed(0)
    ours = stock_class(tiny_family_config(model_type, initializer_range=0.1, attn_implementation=name)).eval()
    eager = stock_class(tiny_family_config(model_type, initializer_range=0.1, attn_implementation="eager")).eval()
    eager.load_state_dict(ours.state_dict())
    return ours, eager


@pytest.mark.parametrize("model_type", STOCK_FAMILIES)
def test_gaudi_fused_sdpa_on_a_stock_class_runs_the_fused_kernel(model_type, monkeypatch):
    model, eager = stock_pair(model_type, "gaudi_fused_sdpa")
    inputs = left_padded_batch(LENGTHS)
    with torch.no_grad(), attention_calls_by_module(monkeypatch) as calls:
        with count_attention_paths(monkeypatch, profile=False) as counts:
            logits = model(**inputs).logits
        assert set(calls) == set(attention_modules(model, model_type))
        assert counts["fused"] == calls.total() and counts["default"] == 0
        with count_attention_paths(monkeypatch, profile=False) as counts:
            default = model(**inputs, use_flash_attention=False).logits  # a call may still turn it off
        assert counts["default"] == calls.total() / 2 and counts["fused"] == 0
        expected = eager(**inputs).logits
    real = inputs["attention_mask"].bool()
    assert (logits[real] - expected[real]).abs().max() <= 1e-4
    assert (default[real] - expected[real]).abs().max() <= 1e-4


@pytest.mark.parametrize("model_type", ["phi", "gpt_oss"])
def test_gaudi_on_a_stock_class_follows_the_flag(model_type, monkeypatch):
    model, _ = stock_pair(model_type, "gaudi")
    inputs = left_padded_batch(LENGTHS)
    with torch.no_grad():
        with count_attention_paths(monkeypatch, profile=False) as counts:
            model(**inputs, use_flash_attention=True)
        assert counts["fused"] > 0 and counts["default"] == 0
        with count_attention_paths(monkeypatch, profile=False) as counts:
            model(**inputs)
        assert counts["default"] > 0 and counts["fused"] == 0


@pytest.mark.parametrize("name", ["gaudi", "gaudi_fused_sdpa"])
@pytest.mark.parametrize("model_type", ["stablelm", "nemotron", "falcon", "gpt_neo", "gpt_neox_japanese"])
def test_a_family_that_does_not_qualify_refuses_the_names(model_type, name):
    """Families whose layers drop the flags, and families whose attention computes its scores itself.

    transformers itself refuses some when the model is built (a family without SDPA support, for the name containing
    "sdpa"; a family that looks its attention class up by name); the others are refused by the Gaudi attention's
    mask function, where transformers builds the masks before the first layer.
    """
    report = family_report(model_type)
    assert not report.qualifies
    stock_class = getattr(transformers, report.class_name)
    try:
        model = stock_class(tiny_family_config(model_type, attn_implementation=name)).eval()
    except (ValueError, KeyError) as refusal:
        assert "does not support an attention implementation" in str(refusal) or name in str(refusal)
        return
    with pytest.raises(
        ValueError, match=f"attn_implementation={name!r} runs the Gaudi attention, which the model type"
    ):
        model(**left_padded_batch(LENGTHS))


# Qualifying families whose stock class has no SDPA (their sinks): transformers' check in the stock
# decoder refused Optimum-Habana's fused name when the Gaudi class was built.
NO_STOCK_SDPA = ("gpt_oss", "mimo_v2_flash")


@pytest.mark.parametrize("model_type", NO_STOCK_SDPA)
def test_the_fused_name_loads_a_gaudi_class_whose_stock_class_has_no_sdpa(model_type, monkeypatch, tmp_path):
    gaudi_class = gaudi_model_class(model_type)
    assert not gaudi_class._supports_sdpa
    torch.manual_seed(0)
    gaudi_class(tiny_family_config(model_type, initializer_range=0.1)).save_pretrained(tmp_path)
    model = gaudi_class.from_pretrained(tmp_path, attn_implementation="gaudi_fused_sdpa").eval()
    built = gaudi_class._from_config(model.config, attn_implementation="gaudi_fused_sdpa")
    assert model.generation_config.use_flash_attention and built.generation_config.use_flash_attention
    assert model.config._attn_implementation == "gaudi_fused_sdpa"
    eager = getattr(transformers, family_report(model_type).class_name).from_pretrained(
        tmp_path, attn_implementation="eager"
    )
    inputs = left_padded_batch(LENGTHS)
    with torch.no_grad(), count_attention_paths(monkeypatch, profile=False) as counts:
        logits = model(**inputs).logits
    assert counts["fused"] > 0 and counts["default"] == 0
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        assert (logits[real] - eager(**inputs).logits[real]).abs().max() <= 1e-4


def test_sdpa_is_refused_by_every_route_where_the_stock_class_has_none():
    """As the stock class refuses it: at load and by set_attn_implementation alike (the latter took it)."""
    gaudi_class = gaudi_model_class("gpt_oss")
    model = gaudi_class(tiny_family_config("gpt_oss"))
    words = "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention"
    with pytest.raises(ValueError, match=words):
        model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match=words):
        gaudi_class._from_config(tiny_family_config("gpt_oss"), attn_implementation="sdpa")
    with pytest.raises(ValueError, match="'gaudi_fused_sdpa' the fused kernel") as refusal:
        model.set_attn_implementation("flex_attention")
    assert "'sdpa'" not in str(refusal.value)
