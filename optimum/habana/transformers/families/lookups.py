"""What a built model asks of its family's report while it runs: answers kept in plain dicts, so that a forward asks
them cheaply, also while torch.compile traces it (a Gaudi model asks once when it is built)."""

from typing import Any

from .qualification import ALTERNATING, WINDOW, family_report


_MASK_FREE: dict[str, bool] = {}
_WINDOWED: dict[str, bool] = {}


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


def attention_modules_of(model: Any) -> list[Any]:
    """The model's modules of its family's attention classes (`FamilyReport.attention_classes`): the ones the Gaudi
    attention serves."""
    classes = set(family_report(model.config.model_type).attention_classes)
    return [module for module in model.modules() if type(module).__name__ in classes]


__all__ = ["attention_modules_of", "family_is_windowed", "family_runs_mask_free"]
