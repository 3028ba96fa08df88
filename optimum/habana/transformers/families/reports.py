"""Each family's report, read from the table kept for the installed transformers before any code is read.

Working a family out reads its modeling code, which takes a few hundredths of a second per family and seconds for
all of them (7 of the 9 that `adapt_transformers_to_gaudi()` took on two cores). So the whole table is worked out once
per installed transformers and per version of the rules, and kept in the cache folder (`OPTIMUM_HABANA_CACHE`) under a
name that hashes both: a changed rule or modeling file gets a table of its own, never a stale one. Where no table is
kept yet, a family's report is worked out alone (`judge_family`); `family_table()` works out and keeps the table.
"""

import functools
import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import transformers

from ...utils.atomic import atomic_write_text
from ...utils.cache_folder import cache_root
from ...version import __version__
from .qualification import FamilyReport, causal_lm_model_types, judge_family


# The files whose code decides a report, besides transformers' modeling files.
RULES = ("qualification.py", "source_facts.py", "mask_facts.py", "branches.py", "cache_facts.py")

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


@functools.cache
def family_report(model_type: str) -> FamilyReport:
    """What the library makes of `model_type`: the kept table's report where there is one, else worked out now."""
    kept = _kept_table()
    if kept is not None and model_type in kept:
        return kept[model_type]
    return judge_family(model_type)


def family_table() -> dict[str, FamilyReport]:
    """Every causal-LM model type of the installed transformers and what the library makes of it."""
    return dict(_family_table())


@functools.cache
def _family_table() -> tuple[tuple[str, FamilyReport], ...]:
    kept = _kept_table()
    if kept is not None:
        return tuple(kept.items())
    table = tuple((model_type, judge_family(model_type)) for model_type in causal_lm_model_types())
    try:
        table_path().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(
            table_path(), json.dumps({model_type: asdict(report) for model_type, report in table}, indent=1)
        )
    except OSError:
        pass  # a read-only cache folder: the table is worked out again next time
    return table


@functools.cache
def _kept_table() -> dict[str, FamilyReport] | None:
    """The kept table, read once; None where there is none yet, or it is damaged (any content it cannot read: worked
    out again, never half read)."""
    try:
        stored = json.loads(table_path().read_text(encoding="utf-8"))
        if not isinstance(stored, dict) or set(stored) != set(causal_lm_model_types()):
            raise TypeError("not a table of every causal-LM model type's report")
        return {model_type: _report_from_json(model_type, fields) for model_type, fields in stored.items()}
    except (OSError, ValueError, TypeError, KeyError):
        return None


def table_path() -> Path:
    return cache_root() / "families" / f"{_fingerprint()}.json"


def _report_from_json(model_type: str, fields: object) -> FamilyReport:
    """A stored report, every field of its type; a TypeError for anything else."""
    if not isinstance(fields, dict) or fields.keys() != _STORED_FIELDS.keys() or fields["model_type"] != model_type:
        raise TypeError(f"the stored report of {model_type!r} is not a report")
    for name, kind in _STORED_FIELDS.items():
        value = fields[name]
        if type(value) is not kind or (kind is list and not all(isinstance(item, str) for item in value)):
            raise TypeError(f"the stored report of {model_type!r} has {name}={value!r}")
    return FamilyReport(**{name: tuple(value) if type(value) is list else value for name, value in fields.items()})


@functools.cache
def _fingerprint() -> str:
    """The installed transformers (version and modeling files) and this package's rules, as a short hash."""
    digest = hashlib.sha256(f"{transformers.__version__} {__version__}".encode())
    for rules in RULES:
        digest.update((Path(__file__).parent / rules).read_bytes())
    for path in sorted(Path(transformers.__file__).parent.glob("models/*/modeling_*.py")):
        status = path.stat()
        digest.update(f"{path.name} {status.st_size} {status.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


__all__ = ["family_report", "family_table"]
