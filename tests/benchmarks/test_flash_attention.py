"""Smoke test of examples/text-generation/benchmark_flash_attention.py on a tiny random Llama.

No timing assertions: it checks the table's columns, the JSON, that every ratio is computed from the measured
numbers, and the OOM and timeout cells. The workers are separate processes, as in real use.
"""

import csv
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from optimum.habana import GaudiLlamaForCausalLM
from optimum.habana.cli.benchmarks.inference import arguments as inference_arguments
from optimum.habana.cli.benchmarks.inference import command as inference_command
from optimum.habana.cli.benchmarks.models import PRESETS, ModelSpec, build_model, floor_attention
from tests.helpers import ROOT, load_script, tiny_llama_config


SCRIPT = ROOT / "examples" / "text-generation" / "benchmark_flash_attention.py"
COLUMNS = [
    "Model",
    "BS",
    "Max input tokens",
    "Max new tokens",
    "Default throughput [tokens/s]",
    "Flash throughput [tokens/s]",
    "Throughput improvement",
    "Default memory [GiB]",
    "Flash memory [GiB]",
    "Memory reduction [GiB]",
    "Default prefill [s]",
    "Flash prefill [s]",
    "Floor extra memory [GiB]",
    "Default / floor extra",
    "Flash / floor extra",
    "Noise [%]",
]


@pytest.fixture(scope="module")
def script():
    return load_script("examples/text-generation/benchmark_flash_attention.py")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    GaudiLlamaForCausalLM(tiny_llama_config(max_position_embeddings=8192)).save_pretrained(folder)
    return folder


def run(script, argv: list[str], capsys) -> tuple[str, dict]:
    assert script.main(argv) == 0
    output = capsys.readouterr().out
    output_dir = Path(argv[argv.index("--output_dir") + 1])
    return output, json.loads((output_dir / "results.json").read_text())


def test_table_json_ratios_and_oom(script, checkpoint, tmp_path, capsys):
    """A short prompt runs everywhere, with the floor; at 2048 tokens (a run of its own, without the floor: one process
    fewer) the default path's score matrix exceeds the memory cap."""
    output_dir = tmp_path / "results"
    common = ["--model_name_or_path", str(checkpoint), "--batch_sizes", "2", "--max_new_tokens", "2", "--ragged"]
    common += ["--warmup", "0", "--n_iterations", "2"]
    argv = [*common, "--max_input_tokens", "16", "--output_dir", str(output_dir), "--plot"]
    output, results = run(script, argv, capsys)

    header = next(line for line in output.splitlines() if line.startswith("| Model"))
    assert [name.strip() for name in header.strip("|").split("|")] == COLUMNS
    (short,) = results["rows"]
    assert short["max_input_tokens"] == 16
    assert set(short["paths"]) == {"default", "flash", "floor"}
    for path in ("default", "flash"):
        measured = short["paths"][path]
        assert measured["status"] == "ok" and len(measured["throughputs"]) == 2
        assert measured["new_tokens"] == 2 and measured["peak_memory_bytes"] > 0
    default, flash, floor = (short["paths"][path] for path in ("default", "flash", "floor"))
    assert short["throughput_improvement"] == pytest.approx(
        flash["throughput_tokens_per_second"] / default["throughput_tokens_per_second"]
    )
    assert short["memory_reduction_bytes"] == default["peak_memory_bytes"] - flash["peak_memory_bytes"]
    assert short["flash_extra_vs_floor"] == pytest.approx(flash["extra_memory_bytes"] / floor["extra_memory_bytes"])
    csv_header = (output_dir / "results.csv").read_text().splitlines()[0]
    assert csv_header.split(",") == [*COLUMNS, "complete"]
    assert {line.rsplit(",", 1)[1] for line in (output_dir / "results.csv").read_text().splitlines()[1:]} == {"yes"}
    assert (output_dir / "flash_attention.png").read_bytes().startswith(b"\x89PNG")
    assert results["memory_column"] == "process peak resident memory"

    # The default path cannot hold 2 x 4 heads x 2048² fp32 scores (134 MB) under a 0.1 GB cap; the flash path can.
    argv = [*common, "--max_input_tokens", "2048", "--no_floor", "--memory_limit_gb", "0.1"]
    output, results = run(script, [*argv, "--output_dir", str(tmp_path / "long")], capsys)
    (long,) = results["rows"]
    assert long["paths"]["default"]["status"] == "oom"
    assert long["paths"]["flash"]["status"] == "ok"
    assert long["throughput_improvement"] is None and long["memory_reduction_bytes"] is None
    (long_row,) = results["table"]
    assert long_row["Default throughput [tokens/s]"] == long_row["Default memory [GiB]"] == "OOM"
    assert long_row["Throughput improvement"] == "-"
    assert f"| {long_row['Flash throughput [tokens/s]']}" in output


def test_timeout_is_reported_and_the_grid_goes_on(script, checkpoint, tmp_path, capsys):
    argv = [
        "--model_name_or_path", str(checkpoint),
        "--batch_sizes", "1", "2",
        "--max_input_tokens", "8",
        "--max_new_tokens", "2",
        "--no_floor",
        "--timeout", "0.2",
        "--output_dir", str(tmp_path / "results"),
    ]  # fmt: skip
    output, results = run(script, argv, capsys)
    assert len(results["rows"]) == 2
    for row in results["rows"]:
        assert {result["status"] for result in row["paths"].values()} == {"timeout"}
    for row in results["table"]:
        assert row["Default throughput [tokens/s]"] == row["Flash memory [GiB]"] == "timeout"


def test_existing_results_are_never_overwritten_silently(script, checkpoint, tmp_path, capsys):
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--model_name_or_path", str(checkpoint), "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "results.json").read_text() == "{}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch_sizes", "0"], "--batch_sizes takes positive integers"),
        (["--plot"], "--plot writes a PNG into --output_dir"),
        (["--model_name_or_path", "./no/such/folder"], "does not exist"),
    ],
)
def test_bad_arguments_are_usage_errors_before_any_run(script, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error


def bad_setup(tmp_path: Path, checkpoint: Path) -> dict[str, tuple[list[str], str]]:
    taken = tmp_path / "taken"
    taken.write_text("x")
    truncated = Path(shutil.copytree(checkpoint, tmp_path / "truncated"))
    os.truncate(truncated / "model.safetensors", 1000)
    return {
        "output_dir is a file": (["--output_dir", str(taken)], f"--output_dir '{taken}' is a file"),
        "output_dir cannot be created": (["--output_dir", str(taken / "sub")], "cannot be written"),
        "mistyped preset": (
            ["--model_name_or_path", "llama2-13b-attn"],
            f"'llama2-13b-attn' is not a preset: did you mean 'llama2-7b-attn'? The presets are {', '.join(PRESETS)}.",
        ),
        "truncated weights": (["--model_name_or_path", str(truncated)], "model.safetensors is damaged or truncated"),
    }


def test_bad_setup_is_refused_before_the_first_row(script, checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_run(*args, **kwargs):
        raise AssertionError("a row was measured before the bad setup was refused")

    monkeypatch.setattr(inference_command, "run_worker", no_run)
    for name, (argv, message) in bad_setup(tmp_path, checkpoint).items():
        if "--model_name_or_path" not in argv:
            argv = ["--model_name_or_path", str(checkpoint), *argv]
        with pytest.raises(SystemExit) as exit_info:
            script.main(argv)
        error = capsys.readouterr().err
        assert exit_info.value.code == 2, name
        assert message in error and "Traceback" not in error, (name, error)


def test_a_failed_run_fails_the_benchmark_and_is_named(script, checkpoint, tmp_path, capsys):
    """Weights whose header has the right length but a damaged content: only loading them (in the worker) fails."""
    damaged = Path(shutil.copytree(checkpoint, tmp_path / "damaged"))
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes().replace(b'"F32"', b'"Q32"', 1))
    argv = ["--model_name_or_path", str(damaged), "--batch_sizes", "1", "--max_input_tokens", "8"]
    argv += ["--max_new_tokens", "2", "--no_floor", "--warmup", "0", "--n_iterations", "1"]
    argv += ["--output_dir", str(tmp_path / "results")]
    assert script.main(argv) == 1
    error_lines = capsys.readouterr().err.strip().splitlines()
    failed = [line for line in error_lines if line.startswith("benchmark_flash_attention.py: failed: ")]
    assert len(failed) == 2
    assert all("BS 1, 8 input tokens, 2 new" in line and "Q32" in line for line in failed)
    assert {"default path" in line for line in failed} == {True, False}
    assert error_lines[-1] == (
        "benchmark_flash_attention.py: error: 2 run(s) failed for a reason other than OOM or timeout (above); their "
        "cells say 'error'."
    )
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    assert results["table"][0]["Default throughput [tokens/s]"] == "error"


def test_compared_paths_are_stock_transformers_and_alternate(checkpoint):
    spec = ModelSpec(str(checkpoint))
    for path in ("eager", "sdpa"):
        model = build_model(spec, path, torch.float32, seed=0)
        assert type(model) is LlamaForCausalLM and model.config._attn_implementation == path
    assert isinstance(build_model(spec, "flash", torch.float32, seed=0), GaudiLlamaForCausalLM)
    arguments = inference_arguments.BenchmarkArguments(compare_transformers=True)
    assert inference_command.paths_for(arguments, 0) == ["default", "flash", "eager", "sdpa", "floor"]
    assert inference_command.paths_for(arguments, 1) == ["floor", "sdpa", "eager", "flash", "default"]


def test_floor_passes_v_through_for_each_query_head():
    value = torch.arange(2 * 2 * 5 * 3, dtype=torch.float32).view(2, 2, 5, 3)
    query = torch.zeros(2, 4, 5, 3)
    output, _ = floor_attention(None, query, value, value, None)
    assert output.shape == (2, 5, 4, 3)
    assert torch.equal(output[:, :, 1], value[:, 0]) and torch.equal(output[:, :, 3], value[:, 1])
    decode, _ = floor_attention(None, query[:, :, -1:], value, value, None)
    assert torch.equal(decode[:, 0, 2], value[:, 1, -1])


def test_ctrl_c_is_one_line_and_the_rows_so_far_are_marked_incomplete(
    script, checkpoint, tmp_path, capsys, monkeypatch
):
    calls = []

    def first_row_then_ctrl_c(task, timeout, worker):
        calls.append(task)
        if len(calls) > 3:  # the second row
            raise KeyboardInterrupt
        return {"status": "oom", "error": "stand-in"}

    monkeypatch.setattr(inference_command, "run_worker", first_row_then_ctrl_c)
    argv = ["--model_name_or_path", str(checkpoint), "--batch_sizes", "1", "--max_input_tokens", "16", "32"]
    with pytest.raises(SystemExit) as exit_info:
        script.main([*argv, "--max_new_tokens", "2", "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"benchmark_flash_attention.py: interrupted: the measurements so far are in {tmp_path / 'results.json'}, "
        f"{tmp_path / 'results.csv'}, marked incomplete."
    )
    assert json.loads((tmp_path / "results.json").read_text())["complete"] is False
    (row,) = list(csv.DictReader((tmp_path / "results.csv").read_text().splitlines()))
    assert row["Max input tokens"] == "16" and row["complete"] == "no"


def test_help_lists_each_option_once(capsys):
    """HfArgumentParser adds the dashed spelling of an underscored field itself: an alias of it listed it twice."""
    with pytest.raises(SystemExit) as exit_info:
        inference_arguments.build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    options = help_text.split("options:", 1)[1]
    assert options.count("--compare-transformers") == 1
    assert inference_arguments.parse_arguments(
        inference_arguments.build_parser(), ["--compare-transformers"]
    ).compare_transformers
