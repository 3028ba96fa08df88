"""Every causal-LM family of the installed transformers whose attention qualifies, each with its Gaudi class.

The Gaudi class of a family is transformers' own class with `GaudiAttentionMixin` in front, made here from the
stock class (the 14 written in `modeling_causal_lm.py` keep their names and modules). Which families qualify is
decided from their code (`qualification.py`); the full table is worked out once per installed transformers and kept
in the cache folder (`OPTIMUM_HABANA_CACHE`), since reading every family's code takes seconds.
"""

import functools
import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import transformers
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from ...utils.atomic import atomic_write_text
from ...utils.model_loading import cache_root
from ...version import __version__
from ..families.qualification import FamilyReport, causal_lm_model_types, family_report
from ..modeling_utils import GaudiAttentionMixin
from .generated import gaudi_class_of
from .modeling_causal_lm import GAUDI_CAUSAL_LM_CLASSES


def family_table() -> dict[str, FamilyReport]:
    """Every causal-LM model type of the installed transformers and what the library makes of it."""
    return dict(_family_table())


@functools.cache
def _family_table() -> tuple[tuple[str, FamilyReport], ...]:
    path = cache_root() / "families" / f"{_fingerprint()}.json"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(stored, dict):
            raise TypeError(f"a table of reports, not {type(stored).__name__}")
        return tuple((model_type, _report_from_json(model_type, fields)) for model_type, fields in stored.items())
    except (OSError, ValueError, TypeError, KeyError):
        pass  # not worked out yet for this transformers (or damaged: any content it cannot read): work it out again
    table = tuple((model_type, family_report(model_type)) for model_type in causal_lm_model_types())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({model_type: asdict(report) for model_type, report in table}, indent=1))
    except OSError:
        pass  # a read-only cache folder: the table is worked out again next time
    return table


# A stored report's fields and the JSON types each must have (a tuple's items are strings).
_STORED_FIELDS = {
    "model_type": str,
    "class_name": str,
    "qualifies": bool,
    "reason": str,
    "variants": list,
    "mask_free": bool,
    "attention_classes": list,
    "calls_per_attention": int,
}


def _report_from_json(model_type: str, fields: object) -> FamilyReport:
    """A stored report, every field of its type; a TypeError for anything else (a damaged file is worked out
    again, never half read)."""
    if not isinstance(fields, dict) or fields.keys() != _STORED_FIELDS.keys() or fields["model_type"] != model_type:
        raise TypeError(f"the stored report of {model_type!r} is not a report")
    for name, kind in _STORED_FIELDS.items():
        value = fields[name]
        if type(value) is not kind or (kind is list and not all(isinstance(item, str) for item in value)):
            raise TypeError(f"the stored report of {model_type!r} has {name}={value!r}")
    return FamilyReport(**{name: tuple(value) if type(value) is list else value for name, value in fields.items()})


def _fingerprint() -> str:
    """The installed transformers (version and modeling files) and this package's rules, as a short hash."""
    digest = hashlib.sha256(f"{transformers.__version__} {__version__}".encode())
    for rules in ("qualification.py", "source_facts.py", "mask_facts.py", "branches.py", "cache_facts.py"):
        digest.update((Path(__file__).parents[1] / "families" / rules).read_bytes())
    for path in sorted(Path(transformers.__file__).parent.glob("models/*/modeling_*.py")):
        status = path.stat()
        digest.update(f"{path.name} {status.st_size} {status.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def supported_model_types() -> tuple[str, ...]:
    """The model types with a Gaudi causal LM: the 14 written classes first, then every other qualifying family."""
    others = sorted(
        model_type
        for model_type, report in _family_table()
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
