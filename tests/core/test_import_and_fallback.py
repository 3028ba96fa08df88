"""Import without the Gaudi software, the one-line refusal of a transformers outside the tested range (Optimum-Habana's,
say), and the one-warning fallback when no fused kernel can run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optimum.habana import GaudiLlamaForCausalLM
from optimum.habana.kernels import cpu_features, dispatch
from optimum.habana.transformers.attention import matmul_softmax_attention
from optimum.habana.utils import requirements
from optimum.habana.version import TRANSFORMERS_REQUIREMENT, __version__
from tests.helpers import ROOT, count_attention_paths, tiny_llama_config


def test_import_without_habana_frameworks_is_silent():
    code = (
        "import sys, optimum.habana\n"
        "assert 'habana_frameworks' not in sys.modules\n"
        "from optimum.habana import GaudiLlamaForCausalLM, GaudiGenerationConfig, adapt_transformers_to_gaudi\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""


def import_beside(folder: Path, **versions: str) -> subprocess.CompletedProcess:
    """`import optimum.habana` in a fresh interpreter that finds these distributions' metadata (name=version, e.g.
    transformers="4.55.4") before the installed ones; prints whether transformers was imported when it fails."""
    for name, version in versions.items():
        info = folder / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    path = os.pathsep.join([str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")])
    code = "import sys\ntry:\n    import optimum.habana\nfinally:\n    print('transformers' in sys.modules)\n"
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        check=False,
    )


REQUIRED = f"optimum.habana (optimum-gaudi-flash {__version__}) needs transformers{TRANSFORMERS_REQUIREMENT}"


@pytest.mark.parametrize(
    ("versions", "line"),
    [
        (
            {"transformers": "4.55.4", "optimum_habana": "1.19.0"},
            f"{REQUIRED}, but transformers 4.55.4 is installed, most likely for Optimum-Habana 1.19.0, installed in "
            "the same environment (it pins transformers below 4.56 and uses the same import path): pip uninstall "
            "optimum-habana optimum-gaudi-flash, then pip install optimum-gaudi-flash (both install optimum/habana, so "
            "removing one removes files of the other).",
        ),
        (
            {"transformers": "5.24.0"},
            f"{REQUIRED}, but transformers 5.24.0 is installed: pip install 'transformers{TRANSFORMERS_REQUIREMENT}'.",
        ),
    ],
    ids=["optimum-habana's transformers", "a newer transformers"],
)
def test_a_transformers_outside_the_range_stops_the_import_with_one_line(versions, line, tmp_path):
    result = import_beside(tmp_path, **versions)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"ImportError: {line}"
    assert result.stdout == "False\n"  # refused before anything imported transformers


def test_optimum_habana_beside_this_package_is_one_warning(monkeypatch):
    versions = {"transformers": "5.23.0", "optimum-habana": "1.19.0"}
    monkeypatch.setattr(requirements, "installed_version", versions.get)
    with pytest.warns(
        UserWarning, match=r"^Optimum-Habana 1\.19\.0 is installed beside optimum-gaudi-flash .*Keep one: pip"
    ):
        requirements.check_environment()
    monkeypatch.setattr(requirements, "installed_version", {"transformers": "5.23.0"}.get)
    requirements.check_environment()  # alone, in range: nothing to say


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


@pytest.mark.parametrize(
    ("dtype", "native", "column_major"),
    [(torch.bfloat16, False, True), (torch.bfloat16, True, False), (torch.float32, False, False)],
    ids=["bfloat16 emulated", "bfloat16 native", "float32"],
)
def test_the_default_paths_weights_meet_the_values_in_the_layout_the_cpu_product_is_fast_in(
    dtype, native, column_major, monkeypatch
):
    """A half-precision product on a CPU without instructions for it gets the weights column-major
    (`weights_for_value_product`), on a CPU with them row-major, as float32 always: the same output, and the weights
    returned still receive their gradient."""
    monkeypatch.setattr(dispatch, "CPU_NATIVE_PRODUCTS", frozenset({dtype} if native else ()))
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, 5, 8, generator=generator).to(dtype).requires_grad_(True)
    key, value = (torch.randn(2, 2, 5, 8, generator=generator).to(dtype) for _ in range(2))
    operands, matmul = [], torch.matmul

    def product(left, right):
        operands.append(left)
        return matmul(left, right)

    expected, _ = matmul_softmax_attention(query, key, value, None, 8**-0.5)
    monkeypatch.setattr(torch, "matmul", product)
    output, weights = matmul_softmax_attention(query, key, value, None, 8**-0.5)
    monkeypatch.undo()
    assert torch.equal(output, expected)
    layouts = [operand.stride(-2) == 1 for operand in operands[1:]]  # the first product is the scores'
    assert layouts == [column_major]
    weights.retain_grad()
    output.float().sum().backward()
    assert weights.grad is not None and query.grad is not None


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ({"avx2", "amx_bf16", "avx512_fp16"}, {torch.bfloat16, torch.float16}),
        ({"avx2", "avx512_bf16"}, {torch.bfloat16}),
        ({"avx2", "fma"}, set()),
        (
            {"asimd", "bf16"},
            set(),
        ),  # Arm's BF16: not measured, so it keeps the layout measured without such instructions
        (None, set()),  # /proc/cpuinfo unreadable
    ],
)
def test_the_cpus_native_half_precision_products_come_from_its_instruction_sets(flags, native, monkeypatch):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: flags)
    assert cpu_features.cpu_native_products() == native
