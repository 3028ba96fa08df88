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


def test_an_unknown_backend_is_named_and_the_user_facing_ones_offered(script, capsys, monkeypatch, tmp_path):
    line = refused(script, ["--torch_compile", "--torch_compile_backend", "inductr"], capsys, monkeypatch, tmp_path)
    assert "--torch_compile_backend inductr is not a torch.compile backend" in line
    offered = set(line.split("choose one of: ")[1].rstrip(".").split(", "))
    assert {"inductor", "eager", "aot_eager", "cudagraphs", "hpu_backend"} <= offered
    # torch's debugging and internal backends are accepted by name but not offered
    assert not offered & {"invoke_subgraph", "eager_noexcept", "dynamo_minifier_backend", "eager_debug"}, offered


def test_torchs_own_backends_are_not_tried_and_a_broken_one_is_named():
    assert backend_problem("inductor") is None and backend_problem("eager") is None
    assert backend_problem("aot_eager_default_partitioner") is None  # tried: it compiles
    assert backend_problem("dynamo_minifier_backend").startswith("TypeError: ")


def test_a_backend_that_fails_on_the_model_is_one_line(tiny_checkpoint, tmp_path, capsys):
    """It compiles the check's function of one tensor, then fails on the model: one line, nothing written."""
    import torch

    def small_graphs_only(graph, example_inputs):
        if len(graph.graph.nodes) > 8:
            raise NotImplementedError("this backend takes graphs of 8 nodes at most")
        return graph.forward

    torch._dynamo.register_backend(small_graphs_only, name="small_graphs_only")
    script = load_script(SCRIPTS["run_generation.py"])
    argv = ["--model_name_or_path", str(tiny_checkpoint), "--max_new_tokens", "2", "--warmup", "0"]
    argv += ["--torch_compile", "--torch_compile_backend", "small_graphs_only", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "run_generation.py: error: torch.compile (small_graphs_only) failed on the model: NotImplementedError: this "
        "backend takes graphs of 8 nodes at most. No results were written."
    )
    assert not (tmp_path / "out" / "results.json").exists()
