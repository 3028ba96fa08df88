"""Every causal-LM family of the installed transformers whose attention qualifies, each with its Gaudi class.

The Gaudi class of a family is transformers' own class with `GaudiAttentionMixin` in front, made here from the
stock class (the 14 written in `modeling_causal_lm.py` keep their names and modules). Which families qualify is
decided from their code (`families/qualification.py`); the full table is worked out once per installed transformers
and kept in the cache folder (`families/reports.py`), since reading every family's code takes seconds.
"""

import transformers
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from ..families.reports import family_report, family_table
from ..modeling_utils import GaudiAttentionMixin
from .generated import gaudi_class_of
from .modeling_causal_lm import GAUDI_CAUSAL_LM_CLASSES


def supported_model_types() -> tuple[str, ...]:
    """The model types with a Gaudi causal LM: the 14 written classes first, then every other qualifying family."""
    others = sorted(
        model_type
        for model_type, report in family_table().items()
        if report.qualifies and model_type not in GAUDI_CAUSAL_LM_CLASSES
    )
    return (*GAUDI_CAUSAL_LM_CLASSES, *others)


def family_problem(model_type: str) -> str | None:
    """Why `model_type` has no Gaudi class, in one line; None when it has one."""
    if model_type in GAUDI_CAUSAL_LM_CLASSES:
        return None
    report = family_report(model_type)
    return None if report.qualifies else report.reason


def gaudi_model_class(model_type: str) -> type[GaudiAttentionMixin]:
    """The Gaudi causal LM of `model_type`; a ValueError says in one line why a family has none."""
    if model_type in GAUDI_CAUSAL_LM_CLASSES:
        return GAUDI_CAUSAL_LM_CLASSES[model_type]
    report = family_report(model_type)
    if not report.qualifies:
        raise ValueError(f"optimum.habana has no Gaudi model for the model type {model_type!r}: {report.reason}.")
    return gaudi_class_of(getattr(transformers, report.class_name))


def adapt_transformers_to_gaudi() -> None:
    """Make `AutoModelForCausalLM` build the Gaudi class of every supported family.

    This goes through the Auto classes' registry; no transformers class is modified, and models built directly from
    the stock classes keep their stock attention. Each model type's own config class is registered, which is not
    always the class's `config_class`: `llama4` and `qwen3_5` checkpoints carry the composite config, whose causal
    LM is the text model's class; `internlm3` runs Llama's. (`AutoModelForCausalLM.register` refuses a config class
    of another name, so the mapping's own `register` takes them.)
    """
    for model_type in supported_model_types():
        model_class = gaudi_model_class(model_type)
        for config_class in {model_class.config_class, CONFIG_MAPPING[model_type]}:
            AutoModelForCausalLM._model_mapping.register(config_class, model_class, exist_ok=True)


__all__ = [
    "adapt_transformers_to_gaudi",
    "family_problem",
    "family_table",
    "gaudi_model_class",
    "supported_model_types",
]
