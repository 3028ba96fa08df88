"""benchmark_continuous_batching.py and its worker, in this process on a tiny checkpoint (no subprocesses)."""

import json

import pytest

from optimum.habana.cli.benchmarks import workers
from optimum.habana.cli.benchmarks.continuous_batching import worker as cb_benchmark_worker
from tests.helpers import ROOT, load_script, save_tiny_checkpoint


SCRIPT = ROOT / "examples" / "text-generation" / "benchmark_continuous_batching.py"
# What each worker answers in the driver's test: throughputs and token digests.
FAKE_RESULTS = {
    "cb_flash": {"throughput_tokens_per_second": 100.0, "extra_memory_bytes": 1, "tokens_sha256": "a"},
    "cb_default": {"throughput_tokens_per_second": 90.0, "extra_memory_bytes": 1, "tokens_sha256": "b"},
    "stock_cb_sdpa": {"throughput_tokens_per_second": 125.0, "extra_memory_bytes": 1, "tokens_sha256": "a"},
    "static_flash": {"throughput_tokens_per_second": 40.0, "extra_memory_bytes": 1, "tokens_sha256": "a"},
}
# Prompts and new tokens within the tiny checkpoint's 128 positions.
SHORT = ["--max_prompt_tokens", "64", "--max_new_tokens", "16"]
TASK = {"prompt_lengths": [5, 30, 12, 20], "max_new_tokens": 3, "static_batch_size": 2, "max_batch_tokens": 64}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama_cb_benchmark")))


@pytest.fixture(scope="module")
def script():
    return load_script("examples/text-generation/benchmark_continuous_batching.py")


def test_every_path_serves_the_same_tokens_and_reports_its_memory(checkpoint):
    results = {
        path: cb_benchmark_worker.measure({**TASK, "model": checkpoint, "path": path})
        for path in cb_benchmark_worker.PATHS
    }
    for result in results.values():
        assert result["status"] == "ok"
        assert result["new_tokens"] == 4 * 3
        assert result["peak_memory_bytes"] > 0 and result["extra_memory_bytes"] >= 0
    assert len({result["tokens_sha256"] for result in results.values()}) == 1


def workers_run_in_process(monkeypatch) -> list[str]:
    """Each path's worker replaced by its fake result, in this process; returns the paths in the order they ran."""
    calls = []

    def in_process(task, timeout, worker):
        calls.append(task["path"])
        return {**FAKE_RESULTS[task["path"]], "status": "ok", "seconds": 1.0, "peak_memory_bytes": 1 << 30}

    monkeypatch.setattr(workers, "run_worker", in_process)
    return calls


def test_the_driver_writes_the_table_with_both_targets_and_keeps_earlier_results(
    script, checkpoint, tmp_path, monkeypatch
):
    calls = workers_run_in_process(monkeypatch)
    argv = ["--model", checkpoint, *SHORT, "--repeats", "2", "--output_dir", str(tmp_path)]
    assert script.main(argv) == 0
    assert calls == [*cb_benchmark_worker.PATHS, *cb_benchmark_worker.PATHS[1:], cb_benchmark_worker.PATHS[0]]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["complete"] is True and set(results["paths"]) == set(cb_benchmark_worker.PATHS)
    assert [(target["baseline"], target["ratio"], target["met"]) for target in results["targets"]] == [
        ("static_flash", 2.5, True),
        ("stock_cb_sdpa", 0.8, False),
    ]
    table = (tmp_path / "results.md").read_text()
    assert "cb_flash ≥ 2× static_flash: 2.50 (met)" in table and "cb_flash ≥ 1× stock_cb_sdpa: 0.80 (not met)" in table
    assert table.count("| yes") == 3 and table.count("| no") == 1  # cb_default's tokens differ here

    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2
    assert json.loads((tmp_path / "results.json").read_text()) == results


def test_a_path_whose_requests_fail_is_an_error_not_a_fast_row(checkpoint, monkeypatch):
    monkeypatch.setattr(
        cb_benchmark_worker, "serve_continuously", lambda model, requests, config, task: [[]] * len(requests)
    )
    result = cb_benchmark_worker.measure({**TASK, "model": checkpoint, "path": "cb_flash"})
    assert result["status"] == "error" and "requests failed" in result["error"]


def test_requests_the_engine_refuses_are_an_error_with_their_reason(checkpoint):
    result = cb_benchmark_worker.measure({**TASK, "prompt_lengths": [5, 126], "model": checkpoint, "path": "cb_flash"})
    assert result == {
        "status": "error",
        "error": "1 of 2 requests failed; the first: the prompt's 126 tokens and max_new_tokens 3 pass the model's "
        "context of 128 positions (max_position_embeddings): lower max_new_tokens to at most 2 or shorten the prompt.",
    }


def test_prompts_past_the_model_s_positions_are_a_usage_error_before_any_run(script, checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(workers, "run_worker", lambda *args, **kwargs: pytest.fail("a worker ran"))
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--model", checkpoint, "--max_prompt_tokens", "120", "--max_new_tokens", "16"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "benchmark_continuous_batching.py: error: --max_prompt_tokens 120 + --max_new_tokens 16 pass the model's 128 "
        "positions (max_position_embeddings): lower them to 128 tokens in all."
    ]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--requests", "0"], "--requests must be at least 1"),
        (["--min_prompt_tokens", "64", "--max_prompt_tokens", "32"], "--max_prompt_tokens must be at least"),
        (["--paths", "cb_magic"], "invalid choice"),
        (["--threads", "-1"], "error: --threads must be 0 (torch's default) or more, got -1."),
        (["--timeout", "0"], "error: --timeout must be a positive number of seconds, got 0.0."),
        (["--timeout", "-5"], "error: --timeout must be a positive number of seconds, got -5.0."),
    ],
)
def test_bad_values_are_usage_errors(argv, words, script, capsys, monkeypatch):
    monkeypatch.setattr(workers, "run_worker", lambda *args, **kwargs: pytest.fail("a worker ran"))
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def test_a_run_killed_midway_leaves_what_it_measured_marked_incomplete_in_every_file(
    script, checkpoint, tmp_path, monkeypatch, capsys
):
    def interrupted_on_the_third(task, timeout, worker):
        if task["path"] == cb_benchmark_worker.PATHS[2]:
            raise KeyboardInterrupt
        return {**FAKE_RESULTS[task["path"]], "status": "ok", "seconds": 1.0, "peak_memory_bytes": 1 << 30}

    monkeypatch.setattr(workers, "run_worker", interrupted_on_the_third)
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--model", checkpoint, *SHORT, "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"benchmark_continuous_batching.py: interrupted: the measurements so far are in {tmp_path / 'results.json'}, "
        f"{tmp_path / 'results.md'}, marked incomplete."
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["complete"] is False and list(results["paths"]) == list(cb_benchmark_worker.PATHS[:2])
    table = (tmp_path / "results.md").read_text()
    assert table.startswith("**INCOMPLETE**: the run stopped before its end") and "| cb_flash" in table


def test_ctrl_c_before_the_first_result_writes_nothing(script, checkpoint, tmp_path, monkeypatch, capsys):
    def interrupted(task, timeout, worker):
        raise KeyboardInterrupt

    monkeypatch.setattr(workers, "run_worker", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--model", checkpoint, *SHORT, "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "benchmark_continuous_batching.py: interrupted: nothing was written."
    )
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_path_named_twice_runs_once_a_repeat_and_the_finished_run_is_complete(
    script, checkpoint, tmp_path, monkeypatch
):
    calls = workers_run_in_process(monkeypatch)
    argv = ["--model", checkpoint, *SHORT, "--repeats", "1", "--paths", "cb_flash", "static_flash", "cb_flash"]
    assert script.main([*argv, "--output_dir", str(tmp_path)]) == 0
    assert calls == ["cb_flash", "static_flash"]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["complete"] is True and {path: len(runs) for path, runs in results["runs"].items()} == {
        "cb_flash": 1,
        "static_flash": 1,
    }
    assert not (tmp_path / "results.md").read_text().startswith("**INCOMPLETE**")


def test_help_describes_the_benchmark_rather_than_repeating_its_command(script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])
    assert exit_info.value.code == 0
    description = capsys.readouterr().out.split("\n\n")[1]
    assert description.startswith("Serving throughput: continuous batching with the flag")
    assert "python examples/" not in description
