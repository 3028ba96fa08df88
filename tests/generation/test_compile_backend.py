"""`--torch_compile_backend` alike in run_generation.py, run_lm_eval.py and run_lora_clm.py (issue 36): a backend
torch.compile lists but cannot run here (its package is not installed) is one line and exit status 2 before the
model loads, as is a backend without `--torch_compile` (run_lora_clm.py compiled anyway) and an unknown name
(run_lora_clm.py ended in accelerate's ValueError traceback)."""

import importlib.util

import pytest

from optimum.habana.cli.compile_backend import backend_problem
from tests.helpers import load_script


SCRIPTS = {
    "run_generation.py": "examples/text-generation/run_generation.py",
    "run_lm_eval.py": "examples/text-generation/run_lm_eval.py",
    "run_lora_clm.py": "examples/language-modeling/run_lora_clm.py",
}
ARGV = {"run_lm_eval.py": ["-o", "unused.json"], "run_lora_clm.py": ["--output_dir", "unused", "--do_train"]}


@pytest.fixture(scope="module", params=list(SCRIPTS))
def script(request):
    return request.param, load_script(SCRIPTS[request.param])


def refused(script, argv: list[str], capsys, monkeypatch, tmp_path) -> str:
    name, module = script
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        module.main([*ARGV.get(name, []), *argv])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"{name}: error: ") and "Traceback" not in "\n".join(lines)
    assert not any(tmp_path.iterdir())  # refused before anything was written
    return lines[-1]


@pytest.mark.skipif(importlib.util.find_spec("tvm") is not None, reason="TVM is installed here")
def test_a_backend_that_cannot_be_imported_is_one_line(script, capsys, monkeypatch, tmp_path):
    line = refused(script, ["--torch_compile", "--torch_compile_backend", "tvm"], capsys, monkeypatch, tmp_path)
    assert "--torch_compile_backend tvm cannot compile here (ImportError: Please install apache-tvm" in line


def test_a_backend_needs_torch_compile(script, capsys, monkeypatch, tmp_path):
    line = refused(script, ["--torch_compile_backend", "eager"], capsys, monkeypatch, tmp_path)
    assert line.endswith("--torch_compile_backend eager picks torch.compile's backend: add --torch_compile.")


def test_an_unknown_backend_is_named(script, capsys, monkeypatch, tmp_path):
    line = refused(script, ["--torch_compile", "--torch_compile_backend", "inductr"], capsys, monkeypatch, tmp_path)
    assert "--torch_compile_backend inductr is not a torch.compile backend" in line and "inductor" in line


def test_torchs_own_backends_are_not_tried_and_a_broken_one_is_named():
    assert backend_problem("inductor") is None and backend_problem("eager") is None
    assert backend_problem("aot_eager_default_partitioner") is None  # tried: it compiles
    assert backend_problem("dynamo_minifier_backend").startswith("TypeError: ")
