"""Every causal-LM model type of the installed transformers: a qualifying family holds the contract of the 14 written
ones against its stock class; any other is refused in one line that says why.

The families and the verdicts come from the library (`family_table`), not from a list written here.
"""

import pytest
import torch

from optimum.habana import gaudi_model_class
from optimum.habana.kernels import dispatch
from optimum.habana.transformers.families.qualification import causal_lm_model_types
from optimum.habana.transformers.models import family_table
from tests.families.support import (
    LENGTHS,
    NEW_TOKENS,
    assert_same_steps,
    attention_calls_by_module,
    attention_modules,
    family_pair,
    greedy,
)
from tests.helpers import count_attention_paths, left_padded_batch


@pytest.mark.parametrize("model_type", causal_lm_model_types())
def test_family_runs_fused_with_stock_tokens_or_is_refused(model_type, monkeypatch):
    report = family_table()[model_type]
    if not report.qualifies:
        assert report.reason and "\n" not in report.reason
        with pytest.raises(ValueError, match="no Gaudi model for the model type") as refusal:
            gaudi_model_class(model_type)
        assert report.reason in str(refusal.value)
        return
    gaudi_class = gaudi_model_class(model_type)
    own_type = gaudi_class.config_class.model_type
    if own_type != model_type and own_type in causal_lm_model_types():  # `llama4` runs `llama4_text`'s class
        assert gaudi_model_class(own_type) is gaudi_class
        return
    ours, stock = family_pair(model_type)
    inputs = left_padded_batch(LENGTHS)
    modules = attention_modules(ours, model_type)
    assert modules
    reference = greedy(stock, inputs)
    with attention_calls_by_module(monkeypatch) as calls, count_attention_paths(monkeypatch, profile=False) as counts:
        default = greedy(ours, inputs)
    # every attention module, at the prompt and at each step after it: the flag's path reaches every one
    assert set(calls) == set(modules) and min(calls.values()) >= NEW_TOKENS
    assert counts["fused"] == 0 and counts["default"] == calls.total()
    dispatch.warn_once.cache_clear()
    with attention_calls_by_module(monkeypatch) as calls, count_attention_paths(monkeypatch, profile=False) as counts:
        flash = greedy(ours, inputs, use_flash_attention=True)
    assert set(calls) == set(modules)
    if "soft-capped logits" in report.variants:
        assert counts["fused"] + counts["default"] == calls.total()
    else:  # a local layer's prompt runs in two fused calls (its first window, then the rest): at least one each
        assert counts["fused"] >= calls.total() and counts["default"] == 0
    assert_same_steps(default, reference)
    assert_same_steps(flash, reference)
    with torch.no_grad():
        expected = stock(**inputs).logits
        logits = ours(**inputs, use_flash_attention=True).logits
    real = inputs["attention_mask"].bool()
    assert (logits[real] - expected[real]).abs().max() <= 1e-4
