"""Import without the Gaudi software, and the one-warning fallback when no fused kernel can run."""

import subprocess
import sys

import pytest
import torch

from optimum.habana import GaudiLlamaForCausalLM
from optimum.habana.kernels import dispatch
from optimum.habana.transformers.attention import matmul_softmax_attention
from tests.helpers import count_attention_paths, tiny_llama_config


def test_import_without_habana_frameworks_is_silent():
    code = (
        "import sys, optimum.habana\n"
        "assert 'habana_frameworks' not in sys.modules\n"
        "from optimum.habana import GaudiLlamaForCausalLM, GaudiGenerationConfig, adapt_transformers_to_gaudi\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""


def test_dropout_on_cpu_warns_once_and_runs_the_default_path(monkeypatch):
    """PyTorch's CPU fused kernel has no dropout: the flag then warns once, and attention stays correct."""
    torch.manual_seed(0)
    model = GaudiLlamaForCausalLM(tiny_llama_config(attention_dropout=0.1)).train()
    input_ids = torch.randint(3, 256, (2, 8))
    dispatch.warn_once.cache_clear()
    with pytest.warns(UserWarning) as record, count_attention_paths(monkeypatch) as counts:
        model(input_ids, use_flash_attention=True)
        model(input_ids, use_flash_attention=True)
    messages = [str(warning.message) for warning in record if "use_flash_attention" in str(warning.message)]
    assert len(messages) == 1
    assert "no fused attention kernel" in messages[0] and "dropout 0.1" in messages[0]
    assert counts["fused"] == 4 and counts["default"] == 4


def test_fast_softmax_off_gaudi_warns_once(monkeypatch):
    torch.manual_seed(0)
    model = GaudiLlamaForCausalLM(tiny_llama_config()).eval()
    input_ids = torch.randint(3, 256, (1, 8))
    dispatch.warn_once.cache_clear()
    with pytest.warns(UserWarning, match="flash_attention_fast_softmax has no equivalent") as record:
        model(input_ids, use_flash_attention=True, flash_attention_fast_softmax=True)
    assert len(record) == 1


def test_default_path_grouped_query_attention_matches_repeated_heads():
    """The grouped view of the query equals repeating key/value per head, as transformers' eager path does."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, 5, 8, generator=generator)
    key = torch.randn(2, 2, 5, 8, generator=generator)
    value = torch.randn(2, 2, 5, 8, generator=generator)
    output, weights = matmul_softmax_attention(query, key, value, None, 8**-0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, dim=1), value.repeat_interleave(3, dim=1), is_causal=True
    )
    torch.testing.assert_close(output, expected.transpose(1, 2))
    assert weights.shape == (2, 6, 5, 5) and torch.all(weights.triu(1) == 0)
