"""The Gaudi model of any family beside the stock one, and what the family tests compare."""

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.generation.utils import GenerateDecoderOnlyOutput

from optimum.habana import gaudi_model_class
from optimum.habana.transformers.models import family_report
from tests.families.tiny_configs import tiny_family_config, with_attention_that_matters


NEW_TOKENS = 3
LENGTHS = [12, 5, 9]  # a left-padded batch, longer than the tiny windows and chunks (8 tokens)
LOGITS_TOLERANCE = 1e-4  # at every step, as at the prompt's real positions: fp32 against stock eager


def family_pair(
    model_type: str, reference_attention: str | None = "eager", **overrides
) -> tuple[PreTrainedModel, PreTrainedModel]:
    """The Gaudi model and the stock model of a family, with the same random weights, in eval mode: stock eager, or
    with `reference_attention=None` the attention the config names by default (SDPA where the class has it)."""
    gaudi_class = gaudi_model_class(model_type)
    stock = next(cls for cls in gaudi_class.__mro__ if cls.__module__.startswith("transformers."))
    config_class = gaudi_class.config_class
    torch.manual_seed(0)
    ours = gaudi_class(tiny_family_config(model_type, config_class, initializer_range=0.1, **overrides)).eval()
    with_attention_that_matters(ours, model_type)
    attention = {"attn_implementation": reference_attention} if reference_attention else {}
    reference = stock(tiny_family_config(model_type, config_class, initializer_range=0.1, **attention, **overrides))
    reference.load_state_dict(ours.state_dict())
    return ours, reference.eval()


def attention_modules(model: torch.nn.Module, model_type: str) -> list[torch.nn.Module]:
    """The modules whose attention goes through the interface: one Gaudi attention call each per forward."""
    names = set(family_report(model_type).attention_classes)
    return [module for module in model.modules() if type(module).__name__ in names]


def greedy(model, inputs, **kwargs) -> GenerateDecoderOnlyOutput:
    """The tokens and every step's logits: the prompt's last position, then each decode step's, where the decode
    kernels run."""
    return model.generate(
        **inputs,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )


def assert_same_steps(found: GenerateDecoderOnlyOutput, expected: GenerateDecoderOnlyOutput) -> None:
    """The same tokens, and at every step logits within LOGITS_TOLERANCE of the expected ones: a wrong decode step
    can leave three greedy tokens unchanged."""
    assert torch.equal(found.sequences, expected.sequences)
    assert len(found.logits) == len(expected.logits) == NEW_TOKENS
    for step, (logits, reference) in enumerate(zip(found.logits, expected.logits, strict=True)):
        difference = (logits - reference).abs().max().item()
        assert difference <= LOGITS_TOLERANCE, f"step {step}: logits {difference:.2e} from the reference's"


@contextmanager
def attention_calls_by_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter]:
    """Count the calls of the Gaudi attention per calling module (a family may call it more than once per layer)."""
    calls: Counter = Counter()

    def counted(registered):
        def call(module, *args, **kwargs):
            calls[module] += 1
            return registered(module, *args, **kwargs)

        return call

    with monkeypatch.context() as patch:
        for name in ("gaudi", "gaudi_fused_sdpa"):
            patch.setitem(AttentionInterface._global_mapping, name, counted(AttentionInterface._global_mapping[name]))
        yield calls


def repeated_layers(config, times: int) -> dict:
    """Config overrides that repeat the config's layers (and their kinds) `times` over."""
    overrides = {"num_hidden_layers": config.num_hidden_layers * times}
    for name in ("layer_types", "mlp_layer_types"):
        kinds = getattr(config, name, None)
        if isinstance(kinds, list) and len(kinds) == config.num_hidden_layers:
            overrides[name] = kinds * times
    return overrides


def save_family_checkpoint(folder: Path, model_type: str, tokenizer) -> Path:
    """A stock checkpoint of a tiny `model_type`, as a user would pass it, with `tokenizer` beside it."""
    config_class = gaudi_model_class(model_type).config_class
    config = tiny_family_config(model_type, config_class, vocab_size=len(tokenizer), initializer_range=0.1)
    stock = next(cls for cls in gaudi_model_class(model_type).__mro__ if cls.__module__.startswith("transformers."))
    torch.manual_seed(0)
    stock(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
