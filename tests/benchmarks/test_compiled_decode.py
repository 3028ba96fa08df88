"""benchmark_compiled_decode.py: the flag and stock SDPA, both compiled by generate(), side by side; shrunk here to a
tiny checkpoint and dynamo's eager backend (the table's columns, not its timings, are what a test can check)."""

import pytest

from tests.helpers import load_script, save_tiny_checkpoint


def test_smoke_run_prints_both_models_their_ratio_and_the_bound(tmp_path, capsys):
    script = load_script("examples/text-generation/benchmark_compiled_decode.py")
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    argv = ["--model_name_or_path", str(checkpoint), "--batch_sizes", "1", "3", "--max_new_tokens", "3"]
    assert script.main([*argv, "--n_iterations", "1", "--backend", "eager", "--bandwidth_gib", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "Read bandwidth:" in out
    header = out.splitlines()[-4]
    for column in (
        "flag decode tok/s",
        "stock sdpa decode tok/s",
        "flag / stock",
        "read-bound tok/s",
        "weight GEMVs alone tok/s",
    ):
        assert column in header
    batch_one, batch_three = out.splitlines()[-2:]
    assert batch_one.split("|")[1].strip() == "1" and batch_one.split("|")[-2].strip() != "-"
    assert batch_three.split("|")[1].strip() == "3" and batch_three.split("|")[-2].strip() == "-"


def test_bad_arguments_are_usage_errors():
    script = load_script("examples/text-generation/benchmark_compiled_decode.py")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--max_new_tokens", "1"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--threads", "-1"], "--threads must be at least 1, got -1 (leave it out for torch's own count)."),
        (["--threads", "0"], "--threads must be at least 1, got 0 (leave it out for torch's own count)."),
        (
            ["--backend", "foo"],
            "--backend foo is not a torch.compile backend this script can use (it compiles on CPU); choose one of: ",
        ),
        (
            ["--model_name_or_path", "/nonexistent/checkpoint"],
            "--model_name_or_path: The path '/nonexistent/checkpoint' does not exist.",
        ),
    ],
)
def test_values_that_cannot_run_are_one_line_before_any_model_loads(argv, message, capsys, monkeypatch):
    script = load_script("examples/text-generation/benchmark_compiled_decode.py")
    loaded = []
    monkeypatch.setattr(script.GaudiLlamaForCausalLM, "from_pretrained", lambda *args, **kwargs: loaded.append(args))
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2 and loaded == []
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"benchmark_compiled_decode.py: error: {message}")
