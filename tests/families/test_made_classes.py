"""The classes made from transformers' own are drop-ins as the written ones are: they pickle (a fresh process finds
them by name), save and load, and `adapt_transformers_to_gaudi()` hands them out through the Auto classes."""

import pickle
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

from optimum.habana import adapt_transformers_to_gaudi, gaudi_model_class
from tests.families.support import LENGTHS, family_pair
from tests.helpers import ROOT, left_padded_batch


def test_a_made_class_pickles_and_a_fresh_process_finds_it(tmp_path):
    ours, _ = family_pair("gpt_oss")
    assert type(ours).__module__ == "optimum.habana.transformers.models.generated"
    inputs = left_padded_batch(LENGTHS)
    with torch.no_grad():
        expected = ours(**inputs, use_flash_attention=True).logits
    copy = pickle.loads(pickle.dumps(ours))
    assert type(copy) is type(ours)
    with torch.no_grad():
        assert torch.equal(copy(**inputs, use_flash_attention=True).logits, expected)
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(ours))
    code = (
        f"import pickle; model = pickle.load(open({str(tmp_path / 'model.pkl')!r}, 'rb')); print(type(model).__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "GaudiGptOssForCausalLM"


def test_a_made_class_saves_loads_and_comes_from_the_auto_class(tmp_path):
    ours, _ = family_pair("deepseek_v3")
    ours.generation_config.use_flash_attention = True
    ours.save_pretrained(tmp_path)
    loaded = gaudi_model_class("deepseek_v3").from_pretrained(tmp_path)
    assert loaded.generation_config.use_flash_attention is True
    adapt_transformers_to_gaudi()
    auto = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(auto) is gaudi_model_class("deepseek_v3")
    inputs = left_padded_batch(LENGTHS)
    with torch.no_grad():
        assert torch.equal(auto(**inputs).logits, ours(**inputs).logits)
