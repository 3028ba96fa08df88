"""docs/families.md holds the table `python -m optimum.habana.families` prints, and README.md and docs/attention.md its
summary by variant: generated from the code, not written."""

import json
import re

import pytest
from transformers import AutoModelForCausalLM, Qwen3Config

from optimum.habana.cli import families
from optimum.habana.transformers.families import reports
from tests.helpers import ROOT


def test_the_docs_table_is_the_commands_output(capsys):
    assert families.main([]) == 0
    printed = capsys.readouterr().out.strip()
    doc = (ROOT / "docs" / "families.md").read_text(encoding="utf-8")
    kept = re.search(r"<!-- family-table:[^\n]*-->\n(.*?)\n<!-- /family-table -->", doc, re.DOTALL)
    assert kept is not None and kept.group(1) == printed


def test_the_readme_and_attention_docs_hold_the_commands_summary(capsys):
    assert families.main(["--summary"]) == 0
    printed = capsys.readouterr().out.strip()
    for doc in ("README.md", "docs/attention.md"):
        text = (ROOT / doc).read_text(encoding="utf-8")
        kept = re.search(r"<!-- family-summary:[^\n]*-->\n(.*?)\n<!-- /family-summary -->", text, re.DOTALL)
        assert kept is not None and kept.group(1) == printed, doc


def test_one_row_and_an_unknown_model_type(capsys):
    assert families.main(["--model_type", "stablelm"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| stablelm | `StableLmForCausalLM` (stock) |  | no: StableLmDecoderLayer.forward calls")
    with pytest.raises(SystemExit) as exit_status:
        families.main(["--model_type", "nope"])
    assert exit_status.value.code == 2
    assert "--model_type 'nope' is no causal-LM model type of transformers" in capsys.readouterr().err


def test_a_configs_model_type_gives_its_familys_row(capsys):
    """Emu3's configs (and checkpoints) carry "emu3_text_model", which is no family's key."""
    assert families.main(["--model_type", "emu3_text_model"]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip().splitlines()[-1].startswith("| emu3 | `GaudiEmu3ForCausalLM` |")
    assert "'emu3_text_model' is the model type of the 'emu3' family's configs." in printed.err


DAMAGES = {
    "null": "null",
    "a list": "[]",
    "empty": "",
    "truncated": '{"llama": {"model_type": "llama", "class_na',
    "a report that is null": '{"llama": null}',
    "a flag of the wrong type": "qualifies",
    "a list of numbers": "variants",
    "a missing field": "reason",
    "another family's report": "model_type",
}


@pytest.fixture
def kept_in(tmp_path, monkeypatch):
    """A cache folder of the test's own, each stored answer of `reports` forgotten before and after."""
    from optimum.habana.utils.model_loading import CACHE_ENV_VAR

    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    caches = (reports._family_table, reports._kept_table, reports.family_report, reports._fingerprint)
    for cache in caches:
        cache.cache_clear()
    yield tmp_path
    for cache in caches:
        cache.cache_clear()


def forget(*caches) -> None:
    for cache in caches:
        cache.cache_clear()


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_family_table_is_worked_out_again(damage, kept_in, monkeypatch):
    """Any content the stored table cannot be read from is replaced by the table worked out again, in the same call:
    never a traceback, never a half-read report."""
    monkeypatch.setattr(reports, "causal_lm_model_types", lambda: ("llama",))
    good = reports.family_table()
    (path,) = (kept_in / "families").glob("*.json")
    stored = json.loads(path.read_text(encoding="utf-8"))
    text = DAMAGES[damage]
    if text in ("qualifies", "variants", "reason", "model_type"):
        damaged = json.loads(json.dumps(stored))
        if text == "reason":
            del damaged["llama"]["reason"]
        else:
            damaged["llama"][text] = {"qualifies": "yes", "variants": [1, 2], "model_type": "gpt_oss"}[text]
        text = json.dumps(damaged)
    path.write_text(text, encoding="utf-8")
    forget(reports._family_table, reports._kept_table, reports.family_report)
    assert reports.family_table() == good
    assert json.loads(path.read_text(encoding="utf-8")) == stored  # rewritten whole


def test_a_kept_table_answers_without_reading_any_familys_code(kept_in, monkeypatch):
    """`adapt_transformers_to_gaudi()` asked every family's code on every start (7 s on two cores); with the table kept,
    no report is worked out again, and each is the one worked out."""
    from optimum.habana.transformers.models import registry

    monkeypatch.setattr(reports, "causal_lm_model_types", lambda: ("llama", "qwen3", "stablelm"))  # a few: seconds
    worked_out = reports.family_table()
    forget(reports._family_table, reports._kept_table, reports.family_report)

    def judge_family(model_type):
        raise AssertionError(f"{model_type!r} was worked out again")

    monkeypatch.setattr(reports, "judge_family", judge_family)
    mapping = AutoModelForCausalLM._model_mapping
    monkeypatch.setattr(mapping, "_extra_content", dict(mapping._extra_content))  # registered for this test only
    assert {model_type: reports.family_report(model_type) for model_type in worked_out} == worked_out
    registry.adapt_transformers_to_gaudi()
    assert AutoModelForCausalLM._model_mapping[Qwen3Config] is registry.gaudi_model_class("qwen3")


def test_a_table_kept_for_other_code_is_not_read(kept_in, monkeypatch):
    """Another transformers (or other rules) gets a table of its own: a report is never read from a stale table."""
    monkeypatch.setattr(reports, "causal_lm_model_types", lambda: ("llama", "qwen3"))
    reports.family_table()
    monkeypatch.setattr(reports.transformers, "__version__", "0.0.0")
    forget(reports._family_table, reports._kept_table, reports.family_report, reports._fingerprint)
    worked_out = []
    judge = reports.judge_family
    monkeypatch.setattr(reports, "judge_family", lambda model_type: worked_out.append(model_type) or judge(model_type))
    assert reports.family_report("qwen3").qualifies
    assert worked_out == ["qwen3"]
    assert len(list((kept_in / "families").glob("*.json"))) == 1  # the first table stays; this one is not kept yet
