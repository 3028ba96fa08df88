"""docs/families.md holds the table `python -m optimum.habana.families` prints, and README.md and docs/attention.md its
summary by variant: generated from the code, not written."""

import re

import pytest

from optimum.habana.cli import families
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
