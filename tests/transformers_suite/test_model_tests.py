"""transformers' own model tests as the drop-in contract: every family, with the stock class, the Gaudi class, and
the Gaudi class with the flag on by default.

`ModelTesterMixin` comes from transformers' source distribution (`upstream.py`), the generation tests and the
family tester are this project's (`generation.py`, `tester.py`). A test that passes with the stock class must pass
with both Gaudi variants; `EXCEPTIONS` lists those that cannot, with the reason (docs/drop_in.md says the same).

In CI (the default) Llama runs every test with all three classes and the other families the subset that exercises
attention, masks, training, MoE and generation (`SUBSET`) with the two Gaudi classes; `OPTIMUM_HABANA_MODEL_TESTS=all`
runs every test for every family with all three (about 3 minutes more on 2 cores):
`OPTIMUM_HABANA_MODEL_TESTS=all make test`.
"""

import os
import unittest

import pytest
import torch

from optimum.habana import gaudi_model_class
from tests.helpers import FAMILIES
from tests.transformers_suite.generation import GenerationTesterMixin, stock_class
from tests.transformers_suite.tester import CausalLMTester
from tests.transformers_suite.upstream import model_tester_mixin


ModelTesterMixin = model_tester_mixin().ModelTesterMixin
EVERY_TEST_FOR = FAMILIES if os.environ.get("OPTIMUM_HABANA_MODEL_TESTS") == "all" else ("llama",)
SUBSET = {
    "test_attention_outputs",
    "test_batching_equivalence",
    "test_can_set_attention_dynamically",
    "test_causal_lm_loss_honors_shift_labels",
    "test_config_attn_implementation_setter",
    "test_eager_matches_sdpa_inference_09_fp32_pad_left",
    "test_eager_matches_sdpa_inference_13_fp32_pad_right",
    "test_eager_matches_sdpa_inference_24_fp32_pad_left_output_attentions",
    "test_generate_from_inputs_embeds",
    "test_generate_from_inputs_embeds_with_static_cache",
    "test_generate_with_static_cache",
    "test_greedy_tokens_equal_the_stock_class",
    "test_hidden_states_output",
    "test_inputs_embeds_matches_input_ids",
    "test_left_padding_compatibility",
    "test_model_outputs_equivalence",
    "test_moe_models_record_router_logits",
    "test_output_router_logits_from_config",
    "test_retain_grad_hidden_states_attentions",
    "test_save_load",
    "test_sdpa_can_dispatch_non_composite_models",
    "test_sliding_window_mask",
    "test_training",
    "test_training_gradient_checkpointing",
}
# A compiled decode step costs seconds per model: in CI only Llama (every test) and Gemma 2 (whose soft-capping
# fallback warns) compile; OPTIMUM_HABANA_MODEL_TESTS=all compiles every family.
COMPILED_IN_CI = ("gemma2",)
# generate() compiled with every output (the eager backend: tracing only, a second or two per model): Llama, and the
# families whose Gaudi classes once handed back a bucketed cache there.
COMPILED_OUTPUTS_IN_CI = ("gemma", "mistral", "qwen3_moe")
# Tests that cannot pass with a Gaudi class although they pass with the stock one, and why. None so far: a test
# that looks classes up by name (`_prepare_for_class`'s labels) is given the stock class's name below instead.
EXCEPTIONS: dict[str, str] = {}
VARIANTS = ("Stock", "Gaudi", "GaudiFlash")


def flag_on_by_default(gaudi_class: type) -> type:
    """The Gaudi class with `use_flash_attention` on in every new model's generation config."""

    def __init__(self, config, *args, **kwargs):
        gaudi_class.__init__(self, config, *args, **kwargs)
        self.generation_config.use_flash_attention = True

    return type(f"{gaudi_class.__name__}FlashByDefault", (gaudi_class,), {"__init__": __init__})


def model_test_case(model_type: str, variant: str) -> type:
    gaudi_class = gaudi_model_class(model_type)
    model_class = {"Stock": stock_class(gaudi_class), "Gaudi": gaudi_class}.get(variant) or flag_on_by_default(
        gaudi_class
    )

    def setUp(self):
        torch.manual_seed(0)
        self.model_tester = CausalLMTester(self, model_type)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        # transformers finds which inputs a class takes (labels...) by its name in the auto mappings.
        return ModelTesterMixin._prepare_for_class(self, inputs_dict, stock_class(model_class), return_labels)

    namespace = {"all_model_classes": (model_class,), "setUp": setUp, "_prepare_for_class": _prepare_for_class}
    tests = {
        name for base in (ModelTesterMixin, GenerationTesterMixin) for name in dir(base) if name.startswith("test_")
    }
    if model_type not in EVERY_TEST_FOR:
        kept = SUBSET | ({"test_generate_compile_model_forward_fullgraph"} if model_type in COMPILED_IN_CI else set())
        kept |= {"test_generate_compilation_all_outputs"} if model_type in COMPILED_OUTPUTS_IN_CI else set()
        namespace.update(dict.fromkeys(tests - kept))  # None: not collected
    if variant != "Stock":
        for name, reason in EXCEPTIONS.items():
            namespace[name] = pytest.mark.skip(reason=reason)(getattr(ModelTesterMixin, name))
    name = f"Test{''.join(part.capitalize() for part in model_type.split('_'))}{variant}"
    return type(name, (ModelTesterMixin, GenerationTesterMixin, unittest.TestCase), namespace)


for _model_type in FAMILIES:
    # The stock class is the reference a Gaudi variant's result is read against (EXCEPTIONS): in CI for Llama, for
    # every family with OPTIMUM_HABANA_MODEL_TESTS=all. The Gaudi variants must pass every collected test either way.
    for _variant in VARIANTS if _model_type in EVERY_TEST_FOR else VARIANTS[1:]:
        _case = model_test_case(_model_type, _variant)
        globals()[_case.__name__] = _case
del _case  # pytest would collect the last one twice under this name
