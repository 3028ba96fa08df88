"""What a built model asks of its family's report while it runs: answers kept in plain dicts, so that a forward asks
them cheaply, also while torch.compile traces it (a Gaudi model asks once when it is built)."""

import importlib
from typing import Any

import transformers

from .mask_facts import edits_its_mask
from .qualification import ALTERNATING, NON_ATTENTION_LAYERS, WINDOW
from .reports import family_report


# Layer kinds whose state runs along the sequence (state-space, linear attention, convolutions): they see no example
# boundary in a packed row and no process boundary in a split one.
SEQUENTIAL_LAYERS = NON_ATTENTION_LAYERS - {"mlp", "moe"}

_MASK_FREE: dict[str, bool] = {}
_WINDOWED: dict[str, bool] = {}
_OWN_MASK: dict[str, str | None] = {}


def family_is_windowed(model_type: str) -> bool:
    """Whether the family's masks can hold a sliding window (`WINDOW` or `ALTERNATING` among its variants): the one
    of `config.sliding_window` where its attention is handed none and its config names no layer kinds (PhiMoE). In a
    plain dict, as `family_runs_mask_free`."""
    known = _WINDOWED.get(model_type)
    if known is None:
        known = _WINDOWED[model_type] = bool({WINDOW, ALTERNATING} & set(family_report(model_type).variants))
    return known


def family_runs_mask_free(model_type: str) -> bool:
    """`family_report(model_type).mask_free`, kept in a plain dict: the decoder asks on every forward, also while
    torch.compile traces it (a Gaudi model asks once when it is built, so the answer is known by then)."""
    known = _MASK_FREE.get(model_type)
    if known is None:
        known = _MASK_FREE[model_type] = family_report(model_type).mask_free
    return known


def attention_with_its_own_mask(model_type: str) -> str | None:
    """The family's attention class that makes its own mask from the decoder's (`mask_facts.edits_its_mask`: Qwen4
    merges an indexer's selection into it), or None. Its padded prompts are not planned in the causal-mask mode: the
    rows' valid lengths would stand in for that mask. Read once from the code and kept in a plain dict, as
    `family_runs_mask_free`."""
    if model_type not in _OWN_MASK:
        report = family_report(model_type)
        module = (
            importlib.import_module(getattr(transformers, report.class_name).__module__) if report.qualifies else None
        )
        editing = [name for name in report.attention_classes if module and edits_its_mask(getattr(module, name))]
        _OWN_MASK[model_type] = editing[0] if editing else None
    return _OWN_MASK[model_type]


def attention_modules_of(model: Any) -> list[Any]:
    """The model's modules of its family's attention classes (`FamilyReport.attention_classes`): the ones the Gaudi
    attention serves."""
    classes = set(family_report(model.config.model_type).attention_classes)
    return [module for module in model.modules() if type(module).__name__ in classes]


def call_window(module: Any, config: Any) -> int | None:
    """The sliding window an attention layer's call hands the attention (its `sliding_window` keyword), read before
    any call: a full-attention layer's is None even where the module holds one (Exaone 4), and a family that passes
    only its config's (Mistral) has it from there. Checked against real calls for every served family."""
    layer_types = getattr(config, "layer_types", None) or ()
    index = getattr(module, "layer_idx", None)
    window = getattr(module, "sliding_window", None)
    window = window if isinstance(window, int) else None
    if isinstance(index, int) and index < len(layer_types):
        if layer_types[index] == "full_attention":
            return None
        return window or (config.sliding_window if layer_types[index] == "sliding_attention" else None)
    if window is not None or not family_is_windowed(config.model_type):
        return window
    return getattr(config, "sliding_window", None)


def sequential_layers(config: Any) -> list[str]:
    """The kinds of layer of `config` whose state runs along the sequence (`SEQUENTIAL_LAYERS`)."""
    return sorted(set(getattr(config, "layer_types", None) or ()) & SEQUENTIAL_LAYERS)


__all__ = [
    "SEQUENTIAL_LAYERS",
    "attention_modules_of",
    "call_window",
    "family_is_windowed",
    "family_runs_mask_free",
    "sequential_layers",
]
