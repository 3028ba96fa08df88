"""`run_generation.py --continuous_batching` and `--dataset_name`: the script's main(argv), in this process."""

import json

import pytest
from transformers.generation.continuous_batching.scheduler import Scheduler

from optimum.habana.cli.generation.explain import explain
from optimum.habana.cli.generation.explain.engine import PAGED_ENTRY
from optimum.habana.kernels import cpu_decode
from optimum.habana.transformers import paged_attention
from tests.generation.support import parse
from tests.helpers import count_attention_paths


PROMPTS = ["Hello there", "A much longer prompt about flash attention and paged caches", "2 + 2 ="]


def tiny_argv(checkpoint, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(checkpoint), "--warmup", "0", "--n_iterations", "1", *extra]


def run(script, checkpoint, tmp_path, *extra) -> dict:
    output_dir = tmp_path / "out"
    argv = tiny_argv(checkpoint, "--output_dir", str(output_dir), "--overwrite_output_dir", *extra)
    assert script.main(argv) == 0
    return json.loads((output_dir / "results.json").read_text())


def prompt_arguments() -> list[str]:
    return ["--prompt", *PROMPTS, "--batch_size", "3", "--max_new_tokens", "6"]


@pytest.mark.parametrize("flag", [[], ["--use_flash_attention"]], ids=["default", "flash"])
def test_continuous_batching_gives_each_prompt_its_padded_batch_text_and_times_each_request(
    flag,
    script,
    tiny_checkpoint,
    tmp_path,
    monkeypatch,
):
    batched = run(script, tiny_checkpoint, tmp_path, *prompt_arguments(), *flag)
    with count_attention_paths(monkeypatch, profile=False) as counts:
        continuous = run(script, tiny_checkpoint, tmp_path, *prompt_arguments(), *flag, "--continuous_batching")
    assert [text["output"] for text in continuous["texts"]] == [text["output"] for text in batched["texts"]]
    if flag:
        assert counts["fused"] > 0 and counts["default"] == 0
    else:
        assert counts["default"] > 0 and counts["fused"] == 0
    stats = continuous["stats"]
    assert stats["requests"] == 3 and stats["failed_requests"] == 0 and stats["new_tokens"] == 3 * 6
    for request in stats["per_request"]:
        assert request["status"] == "finished" and request["new_tokens"] == 6
        assert 0 < request["time_to_first_token_seconds"] <= request["seconds"]
        assert request["tokens_per_second"] == pytest.approx(6 / request["seconds"])
    assert continuous["throughput"] == stats["throughput_tokens_per_second"] > 0
    assert {"avg_first_token_latency", "input", "output", "arguments", "versions", "generation_config"} <= set(
        continuous
    )
    assert continuous["arguments"]["continuous_batching"] is True


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--static_shapes"], "--static_shapes shape(s) generate()'s KV cache"),
        (["--bucket_size", "16"], "--bucket_size shape(s)"),
        (["--num_beams", "2"], "no beam search"),
        (["--cb_max_batch_tokens", "0"], "--cb_max_batch_tokens must be at least 1"),
    ],
)
def test_what_continuous_batching_cannot_honour_is_a_usage_error(extra, words, script, tiny_checkpoint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(tiny_argv(tiny_checkpoint, "--continuous_batching", *extra))
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def test_cb_max_batch_tokens_without_continuous_batching_is_a_usage_error(script, tiny_checkpoint, capsys):
    with pytest.raises(SystemExit):
        script.main(tiny_argv(tiny_checkpoint, "--cb_max_batch_tokens", "64"))
    assert "add --continuous_batching" in capsys.readouterr().err


def test_prompts_from_a_local_dataset_file_and_column(script, tiny_checkpoint, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": index, "question": text}) + "\n" for index, text in enumerate(PROMPTS)))
    argv = ["--dataset_name", str(data), "--column_name", "question", "--batch_size", "3", "--max_new_tokens", "2"]
    results = run(script, tiny_checkpoint, tmp_path, *argv, "--continuous_batching")
    assert [text["prompt"] for text in results["texts"]] == PROMPTS


@pytest.mark.parametrize(
    "column, words", [("id", "--column_name 'id' is not a text column"), ("nope", "its text columns: question")]
)
def test_a_dataset_column_that_holds_no_prompts_is_named(column, words, script, tiny_checkpoint, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"id": 1, "question": "hi"}) + "\n")
    with pytest.raises(SystemExit):
        script.main(tiny_argv(tiny_checkpoint, "--dataset_name", str(data), "--column_name", column))
    assert words in capsys.readouterr().err


def sampled_texts(script, checkpoint, tmp_path, seed: str) -> list[str]:
    extra = [*prompt_arguments(), "--continuous_batching", "--do_sample", "--seed", seed, "--n_iterations", "2"]
    results = run(script, checkpoint, tmp_path, *extra)
    return [text["output"] for text in results["texts"]]


def test_continuous_batching_samples_repeat_with_the_seed(script, tiny_checkpoint, tmp_path):
    """The engine samples in a thread of its own: --seed reaches it, and the batch enters it whole."""
    first = sampled_texts(script, tiny_checkpoint, tmp_path, "3")
    assert sampled_texts(script, tiny_checkpoint, tmp_path, "3") == first
    assert sampled_texts(script, tiny_checkpoint, tmp_path, "4") != first


@pytest.mark.parametrize("name", ["prompts.jsonl", "./data/questions.csv", "~/nowhere/prompts.txt"])
def test_a_dataset_file_that_does_not_exist_is_no_such_file(name, script, tiny_checkpoint, capsys, monkeypatch):
    import datasets

    def no_hub(*args, **kwargs):
        raise AssertionError("looked up on the hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    with pytest.raises(SystemExit) as exit_info:
        script.main(tiny_argv(tiny_checkpoint, "--dataset_name", name, "--continuous_batching"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"run_generation.py: error: --dataset_name {name!r}: no such file or folder. Pass your own data file "
        "(.json, .jsonl, .csv, .parquet, .txt) or dataset folder, or a hub dataset id."
    ]


def test_more_prompts_than_batch_size_are_all_requests_at_most_batch_size_per_step(
    script, tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    steps = []
    process_candidates = Scheduler._process_candidates

    def recorded(self, *args, **kwargs):
        result = process_candidates(self, *args, **kwargs)
        steps.append(len(result[0]))
        return result

    monkeypatch.setattr(Scheduler, "_process_candidates", recorded)
    prompts = [*PROMPTS, "One more prompt"]
    results = run(
        script,
        tiny_checkpoint,
        tmp_path,
        "--prompt",
        *prompts,
        "--batch_size",
        "2",
        "--max_new_tokens",
        "4",
        "--continuous_batching",
    )
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("Note:")]
    assert notes == [
        "Note: --batch_size 2 with --continuous_batching: the most requests the engine runs in one step (its "
        "max_requests_per_batch); each of the 4 prompts is a request, and the others wait for a free place."
    ]
    assert [text["prompt"] for text in results["texts"]] == prompts
    stats = results["stats"]
    assert stats["requests"] == 4 and stats["failed_requests"] == 0
    assert stats["paged_cache"]["max_requests_per_batch"] == 2
    assert max(steps) == 2  # the engine used the two places, and never more


def test_fewer_prompts_than_batch_size_are_cycled_to_that_many_requests(script, tiny_checkpoint, tmp_path, capsys):
    results = run(
        script,
        tiny_checkpoint,
        tmp_path,
        "--prompt",
        "Hi",
        "--batch_size",
        "3",
        "--max_new_tokens",
        "4",
        "--continuous_batching",
    )
    assert results["stats"]["requests"] == 3 and results["stats"]["paged_cache"]["max_requests_per_batch"] == 3
    assert "Note:" not in capsys.readouterr().err


@pytest.mark.parametrize("switch", ["1", "0"], ids=["decode kernel", "no decode kernel"])
@pytest.mark.parametrize("flag", [[], ["--use_flash_attention"]], ids=["default", "flash"])
def test_explain_says_what_the_engine_steps_do(flag, switch, script, tiny_checkpoint, tmp_path, monkeypatch):
    """--explain with --continuous_batching accounts for the engine's steps, not generate()'s padded batch: the
    decode lines name the paged entry exactly when the run's decode rows read the paged cache in place."""
    monkeypatch.setenv(cpu_decode.ENV_VAR, switch)
    argv = [*prompt_arguments(), "--continuous_batching", *flag]
    text = explain(parse(tiny_argv(tiny_checkpoint, *argv)))
    assert "each its own request in transformers' continuous batching" in text and "paged cache" in text
    decode_lines = text.split("engine steps decoding")[1].split("Graphs:")[0]
    in_place = []
    attend = paged_attention.paged_decode_sdpa
    monkeypatch.setattr(paged_attention, "paged_decode_sdpa", lambda *a, **k: in_place.append(1) or attend(*a, **k))
    with count_attention_paths(monkeypatch, profile=False) as counts:
        run(script, tiny_checkpoint, tmp_path, *argv)
    assert (PAGED_ENTRY in decode_lines) == bool(in_place), text
    assert ("default path" in text) == bool(counts["default"]), text


@pytest.mark.parametrize("batch_size", ["1", "5"])
def test_explain_counts_the_requests_the_run_serves(batch_size, script, tiny_checkpoint, tmp_path):
    """Three prompts: the engine serves each as a request, cycled up to --batch_size; --explain counts the same (it
    said "1 prompt(s)" with the default --batch_size 1 before)."""
    argv = ["--prompt", *PROMPTS, "--batch_size", batch_size, "--max_new_tokens", "2", "--continuous_batching"]
    text = explain(parse(tiny_argv(tiny_checkpoint, *argv)))
    results = run(script, tiny_checkpoint, tmp_path, *argv)
    assert f"Requests: {results['stats']['requests']} prompt(s) of up to" in text
    assert results["stats"]["requests"] == max(3, int(batch_size))
    assert ("--batch_size 1 with --continuous_batching" in text) == (batch_size == "1")


def test_a_failed_request_is_one_line_and_a_failing_exit_with_the_others_results_kept(
    script, tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    """A request that fails inside the engine (a stand-in: the forward raises on a step holding one prompt's token)
    is reported in one line naming it and its error, exit 1; the results of the run are written (exit 0 before)."""
    from transformers import AutoTokenizer

    from optimum.habana import GaudiLlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    others = {token for prompt in PROMPTS[:2] for token in tokenizer(prompt)["input_ids"]}
    poison = next(token for token in tokenizer(PROMPTS[2])["input_ids"] if token not in others)
    forward = GaudiLlamaForCausalLM.forward

    def forward_or_fail(self, *args, **kwargs):
        if (kwargs.get("input_ids") == poison).any():
            raise RuntimeError("poisoned step")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GaudiLlamaForCausalLM, "forward", forward_or_fail)
    output_dir = tmp_path / "out"
    argv = tiny_argv(tiny_checkpoint, "--prompt", *PROMPTS, "--max_new_tokens", "3", "--continuous_batching")
    assert script.main([*argv, "--output_dir", str(output_dir)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "run_generation.py: error:" in line]
    assert len(errors) == 1 and "requests failed (request req_" in errors[0] and "poisoned step" in errors[0]
    results = json.loads((output_dir / "results.json").read_text())
    failed = [request for request in results["stats"]["per_request"] if request["error"]]
    assert failed and all(request["error"] == "poisoned step" for request in failed)
    assert results["stats"]["failed_requests"] == len(failed) < 3  # the others were served


def test_dataset_rows_beyond_the_batch_are_named_in_a_note(tmp_path):
    """generate() takes --batch_size rows of the pool; --prompt's extra prompts were named in a note, a dataset's
    extra rows were dropped silently (Optimum-Habana users expect the whole dataset)."""
    import torch

    from optimum.habana.cli.generation.arguments import flag_notes

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": text}) + "\n" for text in PROMPTS))
    arguments = parse(["--dataset_name", str(data), "--column_name", "question", "--batch_size", "2"])
    notes = flag_notes(arguments, torch.device("cpu"), torch.float32, pool_size=len(PROMPTS))
    unused = len(PROMPTS) - 2
    assert f"--dataset_name: {len(PROMPTS)} prompts for --batch_size 2: the last {unused} are not used" in notes[-1]
    engine = parse(["--dataset_name", str(data), "--batch_size", "2", "--continuous_batching"])
    assert not any("are not used" in note for note in flag_notes(engine, torch.device("cpu"), torch.float32, 5))
