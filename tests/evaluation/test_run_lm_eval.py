"""Tests of examples/text-generation/run_lm_eval.py (lm-evaluation-harness on the Gaudi classes).

A tiny random Llama (saved with a tokenizer trained here, max 128 positions) runs the two shipped offline tasks
through `main(argv)` in this process, with the attention flag off and on and with --buckets; a wrapper around the
two attention paths counts their calls and records the query shapes the model's attention sees. One test starts
the script in a subprocess, where the hub's offline switches take effect from the start.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoTokenizer

from optimum.habana.cli.evaluation.lm_eval.arguments import (
    ACTING,
    NOT_USED,
    build_parser,
    evaluation_notes,
    parse_arguments,
)
from optimum.habana.cli.evaluation.lm_eval.harness import SHIPPED_TASKS_DIR, check_task_data, score_rows, select_tasks
from optimum.habana.cli.evaluation.lm_eval.prompt_checks import (
    FewshotPool,
    check_chat_template,
    check_num_fewshot,
    check_num_fewshot_fits,
    fewshot_pools,
)
from optimum.habana.cli.evaluation.lm_eval.tasks.flash_mc import flash_mc_items
from optimum.habana.transformers import attention
from optimum.habana.utils.model_loading import CACHE_ENV_VAR
from tests.helpers import ROOT, load_script, save_tiny_checkpoint, spy_on_fused_kernel


SCRIPT = ROOT / "examples" / "text-generation" / "run_lm_eval.py"
SHIPPED = ["--tasks", "essay_perplexity", "flash_mc", "-L", "2", "--batch_size", "4"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def script():
    return load_script("examples/text-generation/run_lm_eval.py")


def recording_attention(patch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...]]]:
    """Every attention call as (path, query shape [B, H, q, D]), "fused" or "default"."""
    calls: list[tuple[str, tuple[int, ...]]] = []

    def recorded(name, function):
        def wrapper(query, *args, **kwargs):
            calls.append((name, tuple(query.shape)))
            return function(query, *args, **kwargs)

        return wrapper

    spy_on_fused_kernel(patch, lambda function: recorded("fused", function))
    patch.setattr(attention, "matmul_softmax_attention", recorded("default", attention.matmul_softmax_attention))
    return calls


def evaluate(script, argv: list[str], output: Path) -> tuple[dict, list]:
    with pytest.MonkeyPatch.context() as patch:
        calls = recording_attention(patch)
        assert script.main([*argv, "-o", str(output)]) == 0
    return json.loads(output.read_text()), calls


@pytest.fixture(scope="module")
def runs(script, tiny, tmp_path_factory) -> dict[str, tuple[dict, list]]:
    """The shipped tasks on the tiny model: flag off, flag on, flag on with buckets (one run each)."""
    folder = tmp_path_factory.mktemp("lm_eval_runs")
    base = [*SHIPPED, "--model_name_or_path", str(tiny)]
    return {
        "off": evaluate(script, base, folder / "off.json"),
        "on": evaluate(script, [*base, "--use_flash_attention"], folder / "on.json"),
        "buckets": evaluate(
            script, [*base, "--use_flash_attention", "--buckets", "16", "32", "64"], folder / "b.json"
        ),
    }


def assert_same_scores(first: dict, second: dict) -> None:
    """Accuracies identical; perplexities equal to fp32 rounding (the two paths sum in different orders)."""
    first_rows, second_rows = score_rows(first), score_rows(second)
    assert first_rows.keys() == second_rows.keys() == {"essay_perplexity", "flash_mc"}
    for task, metrics in first_rows.items():
        for metric, value in metrics.items():
            assert second_rows[task][metric] == pytest.approx(value, rel=1e-5), (task, metric)
    assert first_rows["flash_mc"]["acc"] == second_rows["flash_mc"]["acc"]
    assert first_rows["flash_mc"]["acc_norm"] == second_rows["flash_mc"]["acc_norm"]


def assert_same_scores_of(first: dict, second: dict, task: str) -> None:
    for metric, value in score_rows(first)[task].items():
        assert score_rows(second)[task][metric] == pytest.approx(value, rel=1e-5), (task, metric)


def test_shipped_tasks_run_offline_with_equal_scores_flag_on_and_off(runs):
    assert_same_scores(runs["off"][0], runs["on"][0])
    metrics = score_rows(runs["on"][0])
    assert set(metrics["essay_perplexity"]) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    assert set(metrics["flash_mc"]) == {"acc", "acc_norm"}
    assert runs["on"][0]["n-samples"]["flash_mc"]["effective"] == 2


def test_the_flag_reaches_every_forward_of_both_request_types(runs):
    off_paths = {path for path, _ in runs["off"][1]}
    on_paths = {path for path, _ in runs["on"][1]}
    assert off_paths == {"default"} and on_paths == {"fused"}
    assert len(runs["off"][1]) == len(runs["on"][1])
    # Rolling windows fill the 128 positions; multiple-choice requests are a few tokens long.
    lengths = {shape[2] for _, shape in runs["on"][1]}
    assert 128 in lengths and min(lengths) < 40


def test_output_file_holds_lm_evals_results_plus_args_and_duration(runs):
    results = runs["on"][0]
    assert {"results", "configs", "versions", "n-shot", "config", "args", "duration"} <= results.keys()
    assert results["duration"] > 0
    assert results["args"]["use_flash_attention"] is True
    assert results["args"]["tasks"] == ["essay_perplexity", "flash_mc"]
    assert results["args"]["output_file"].endswith("on.json")


def test_buckets_pad_every_batch_and_keep_the_scores(runs):
    assert_same_scores(runs["on"][0], runs["buckets"][0])
    unbucketed = {shape[2] for _, shape in runs["on"][1]}
    bucketed = {shape[2] for _, shape in runs["buckets"][1]}
    assert not unbucketed <= {16, 32, 64, 128}  # without buckets each batch keeps its own length
    assert bucketed <= {16, 32, 64, 128} and 128 in bucketed  # the 128-token windows add their own bucket
    assert {path for path, _ in runs["buckets"][1]} == {"fused"}


@pytest.mark.parametrize("model_type", ["qwen2", "phi3"])
def test_other_families_run_with_every_call_fused(script, tmp_path, model_type):
    checkpoint = save_tiny_checkpoint(tmp_path / model_type, model_type=model_type)
    argv = ["--tasks", "flash_mc", "-L", "2", "--model_name_or_path", str(checkpoint), "--use_flash_attention"]
    results, calls = evaluate(script, argv, tmp_path / "out.json")
    assert "acc,none" in results["results"]["flash_mc"]
    assert calls and {path for path, _ in calls} == {"fused"}


def test_an_existing_output_file_is_kept_without_overwrite(script, tiny, tmp_path, capsys):
    output = tmp_path / "results.json"
    output.write_text("earlier results")
    with pytest.raises(SystemExit) as raised:
        script.main([*SHIPPED, "--model_name_or_path", str(tiny), "-o", str(output)])
    assert raised.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--overwrite" in error[0] and "-o/--output_file" in error[0]
    assert output.read_text() == "earlier results"


def write_user_task(folder: Path) -> Path:
    """A generate_until task of the user's own, over a local JSON-lines file."""
    folder.mkdir()
    rows = [{"question": f"{a} plus {b}", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (10, 5), (7, 7)]]
    data = folder / "sums.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "my_sums.yaml").write_text(
        "task: my_sums\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {folder / 'cache'}\n"
        "output_type: generate_until\n"
        "test_split: test\n"
        'doc_to_text: "Q: What is {{question}}?\\nA:"\n'
        'doc_to_target: "{{answer}}"\n'
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


def test_a_user_task_folder_runs_generate_until_with_the_flag(script, tiny, tmp_path):
    folder = write_user_task(tmp_path / "tasks")
    base = ["--tasks", "my_sums", "--include_path", str(folder), "--model_name_or_path", str(tiny), "--log_samples"]
    base += ["--batch_size", "4"]
    off, off_calls = evaluate(script, base, tmp_path / "off.json")
    on, on_calls = evaluate(script, [*base, "--use_flash_attention", "--buckets", "32"], tmp_path / "on.json")
    assert "exact_match,none" in on["results"]["my_sums"]
    assert {path for path, _ in off_calls} == {"default"} and {path for path, _ in on_calls} == {"fused"}
    # The prompt's forward (padded to the bucket) and every decode step (one query position) go through the flag.
    assert {shape[2] for _, shape in on_calls} == {32, 1}
    answers = [[sample["resps"] for sample in run["samples"]["my_sums"]] for run in (off, on)]
    assert answers[0] == answers[1]  # the same greedy tokens


def test_generate_until_gives_the_same_answers_with_every_kv_cache_layout(script, tiny, tmp_path):
    folder = write_user_task(tmp_path / "tasks")
    base = ["--tasks", "my_sums", "--include_path", str(folder), "--model_name_or_path", str(tiny), "--log_samples"]
    base += ["--batch_size", "2", "--use_flash_attention"]
    answers = []
    for index, layout in enumerate([[], ["--static_shapes"], ["--bucket_size", "16", "--bucket_internal"]]):
        results, calls = evaluate(script, [*base, *layout], tmp_path / f"{index}.json")
        answers.append([sample["resps"] for sample in results["samples"]["my_sums"]])
        assert {path for path, _ in calls} == {"fused"}
    no_cache, _ = evaluate(script, [*base, "--use_kv_cache", "False"], tmp_path / "no_cache.json")
    answers.append([sample["resps"] for sample in no_cache["samples"]["my_sums"]])
    assert all(answer == answers[0] for answer in answers)


def test_torch_compile_with_its_backend_compiles_both_request_types_and_keeps_the_answers(script, tiny, tmp_path):
    folder = write_user_task(tmp_path / "tasks")
    base = ["--tasks", "flash_mc", "my_sums", "-L", "2", "--include_path", str(folder), "--log_samples"]
    base += ["--model_name_or_path", str(tiny), "--batch_size", "2", "--use_flash_attention", "--buckets", "32"]
    eager, _ = evaluate(script, base, tmp_path / "eager.json")
    torch._dynamo.reset()
    counters.clear()
    # No attention spy here: dynamo would guard on the spy's list of calls and recompile at every call.
    compiled_argv = [*base, "--torch_compile", "--torch_compile_backend", "eager", "-o", str(tmp_path / "c.json")]
    assert script.main(compiled_argv) == 0
    compiled = json.loads((tmp_path / "c.json").read_text())
    assert counters["stats"]["unique_graphs"] >= 2  # the log-likelihood forward and generate()'s decode step
    assert not counters["graph_break"]
    assert compiled["args"]["torch_compile_backend"] == "eager"
    assert_same_scores_of(eager, compiled, "flash_mc")
    answers = [[sample["resps"] for sample in run["samples"]["my_sums"]] for run in (eager, compiled)]
    assert answers[0] == answers[1]


def test_a_hub_task_offline_fails_with_one_line_before_the_model_loads(tiny, tmp_path):
    output = tmp_path / "out.json"
    environment = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    environment[CACHE_ENV_VAR] = str(tmp_path / "cache")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "-o", str(output), "--tasks", "hellaswag", "--model_name_or_path", str(tiny)],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("run_lm_eval.py: error:")]
    assert len(errors) == 1
    assert "hellaswag" in errors[0] and "Rowan/hellaswag" in errors[0] and "HF_DATASETS_OFFLINE=1" in errors[0]
    assert "essay_perplexity flash_mc" in errors[0]
    assert "Model:" not in result.stdout and not output.exists()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["-L", "0"], "-L/--limit"),
        (["--limit", "nan"], "--limit"),
        (["-f", "-1"], "-f/--num_fewshot"),
        (["--buckets", "64", "0"], "--buckets"),
        (["--max_graphs", "0"], "--max_graphs"),
        (["--gen_kwargs", "temperature"], "--gen_kwargs"),
        (["--metadata", "[1, 2]"], "--metadata"),
        (["--metadata", "{oops"], "--metadata"),
        (["--fewshot_as_multiturn"], "--apply_chat_template"),
        (["--include_path", "/no/such/folder"], "--include_path"),
        (["--batch_size", "0"], "--batch_size"),
        (["--tasks", " "], "--tasks"),
        (["--flash_attention_recompute"], "use_flash_attention"),
        (["--bf16", "maybe"], "--bf16"),
    ],
)
def test_bad_values_exit_2_naming_the_flag(script, tmp_path, capsys, argv, flag):
    with pytest.raises(SystemExit) as raised:
        script.main(["-o", str(tmp_path / "out.json"), *argv])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert flag in error and "Traceback" not in error
    assert not (tmp_path / "out.json").exists()


def test_the_output_file_is_required_and_cannot_be_a_folder(script, tmp_path, capsys):
    with pytest.raises(SystemExit) as raised:
        script.main(["--tasks", "flash_mc"])
    error = capsys.readouterr().err
    assert raised.value.code == 2 and "required" in error and "-o" in error and "--output_file" in error
    with pytest.raises(SystemExit) as raised:
        script.main(["-o", str(tmp_path)])
    assert raised.value.code == 2 and "is a folder" in capsys.readouterr().err


def test_flags_that_do_nothing_here_say_so_in_one_line_each(tmp_path):
    given_flags = ["--prompt", "--n_iterations", "--output_dir", "--max_graphs", "--ignore_eos", "--warmup", "--chat"]
    argv = ["-o", str(tmp_path / "out.json"), "--prompt", "hi", "--n_iterations", "2", "--output_dir", str(tmp_path)]
    argv += ["--max_graphs", "4", "--no-ignore_eos", "--warmup", "2", "--use_hpu_graphs", "--chat"]
    argv += ["--trim_logits", "--attn_batch_split", "2"]
    given_flags += ["--trim_logits", "--attn_batch_split"]
    arguments, given = parse_arguments(build_parser(), argv)
    notes = evaluation_notes(arguments, given, torch.device("cpu"), torch.float32)
    for flag in [*given_flags, "--use_hpu_graphs"]:
        assert len([note for note in notes if re.match(rf"{flag}[: ]", note)]) == 1, (flag, notes)
    arguments, given = parse_arguments(build_parser(), ["-o", str(tmp_path / "out.json"), "--continuous_batching"])
    assert evaluation_notes(arguments, given, torch.device("cpu"), torch.float32)[0].startswith(
        "--continuous_batching:"
    )
    arguments, given = parse_arguments(build_parser(), ["-o", str(tmp_path / "out.json")])
    assert not evaluation_notes(arguments, given, torch.device("cpu"), torch.float32)


def test_every_flag_acts_or_has_its_line():
    """A flag added to run_generation.py's dataclasses must be sorted here: acting, or one line saying it does not."""
    destinations = {action.dest for action in build_parser()._actions} - {"help"}
    assert destinations <= ACTING | NOT_USED.keys(), destinations - ACTING - NOT_USED.keys()
    assert not ACTING & NOT_USED.keys()


def test_flash_mc_is_the_generators_output_with_its_licence():
    items = flash_mc_items.generate_items()
    assert flash_mc_items.items_text(items) == flash_mc_items.ITEMS_PATH.read_text(encoding="utf-8")
    test_items = [item for item in items if item["split"] == "test"]
    assert len(test_items) >= 200
    assert all(len(set(item["choices"])) == 4 and 0 <= item["answer"] < 4 for item in items)
    assert len({item["question"] for item in items}) == len(items)
    readme = (SHIPPED_TASKS_DIR / "README.md").read_text()
    assert "Apache-2.0" in readme and "written for this project" in readme


def test_setup_ships_every_task_file():
    setup = (ROOT / "setup.py").read_text()
    patterns = re.search(r'"optimum\.habana\.cli\.evaluation\.lm_eval": \[([^\]]*)\]', setup).group(1)
    package = ROOT / "optimum" / "habana" / "cli" / "evaluation" / "lm_eval"
    shipped = {path for pattern in re.findall(r'"([^"]+)"', patterns) for path in package.glob(pattern)}
    data_files = {path for path in SHIPPED_TASKS_DIR.rglob("*") if path.suffix in {".yaml", ".jsonl", ".md"}}
    assert data_files and data_files <= shipped


@pytest.mark.parametrize(
    "missing, words",
    [
        ("lm_eval", "lm-evaluation-harness is not installed; it is the `eval` extra: "),
        ("sqlitedict", "lm-evaluation-harness cannot be imported ("),
    ],
)
def test_without_lm_eval_the_script_says_which_extra_to_install(missing, words, monkeypatch):
    """`lm_eval` missing (or one of its own dependencies): one line naming the `eval` extra, exit status 1."""
    for name in [name for name in sys.modules if name.startswith("optimum.habana.cli.evaluation.lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    if missing == "lm_eval":
        monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ModuleNotFoundError
    else:
        original = __import__

        def broken_dependency(name, *args, **kwargs):
            if name == "lm_eval":
                raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
            return original(name, *args, **kwargs)

        monkeypatch.setattr("builtins.__import__", broken_dependency)
    with pytest.raises(SystemExit) as exit_info:
        load_script("examples/text-generation/run_lm_eval.py")
    message = exit_info.value.code  # sys.exit(message): Python prints it to stderr and exits with status 1
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith(f"run_lm_eval.py: error: {words}")
    assert message.endswith("pip install 'optimum-gaudi-flash[eval]' (make install includes it).")


@pytest.fixture(scope="module")
def tiny_without_chat_template(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama_no_chat"), chat_template=False)


def refused_before_evaluating(script, argv, capsys, monkeypatch) -> str:
    """main(argv) exits 2 with one line, and lm-eval never starts; returns the line."""

    def must_not_run(*args, **kwargs):
        raise AssertionError("the evaluation started")

    monkeypatch.setattr(script.evaluator, "simple_evaluate", must_not_run)
    with pytest.raises(SystemExit) as raised:
        script.main(argv)
    error = capsys.readouterr().err
    assert raised.value.code == 2 and "Traceback" not in error
    return error.strip().splitlines()[-1]


@pytest.mark.parametrize("flag", ["--apply_chat_template", "--chat"])
def test_a_chat_template_asked_of_a_tokenizer_without_one_is_one_line(
    flag, script, tiny_without_chat_template, tmp_path, capsys, monkeypatch
):
    argv = ["--tasks", "flash_mc", "-L", "2", "--model_name_or_path", str(tiny_without_chat_template), flag]
    line = refused_before_evaluating(script, [*argv, "-o", str(tmp_path / "out.json")], capsys, monkeypatch)
    assert line == (
        f"run_lm_eval.py: error: {flag}: the model's tokenizer has no chat template. Drop {flag} to evaluate the "
        "tasks' prompts as they are, or evaluate a chat model (one whose tokenizer_config.json or "
        "chat_template.jinja holds a template)."
    )
    assert not (tmp_path / "out.json").exists()


def test_a_chat_template_name_must_be_one_of_the_tokenizers(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    check_chat_template(tokenizer, True, "--apply_chat_template")  # its one template
    with pytest.raises(ValueError, match="--apply_chat_template chatml: the tokenizer has one chat template, without"):
        check_chat_template(tokenizer, "chatml", "--apply_chat_template")  # lm-eval would use the one silently
    tokenizer.chat_template = {"default": tokenizer.chat_template, "tool_use": tokenizer.chat_template}
    check_chat_template(tokenizer, "tool_use", "--apply_chat_template")
    with pytest.raises(ValueError, match=r"--apply_chat_template chatml: .* its templates: default, tool_use\."):
        check_chat_template(tokenizer, "chatml", "--apply_chat_template")
    tokenizer.chat_template = {"tool_use": "{{ messages }}"}
    with pytest.raises(ValueError, match="none named 'default': name one, --apply_chat_template NAME"):
        check_chat_template(tokenizer, True, "--apply_chat_template")


def test_more_few_shot_examples_than_the_tasks_hold_is_one_line_before_the_model_loads(
    script, tiny, tmp_path, capsys, monkeypatch
):
    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(script.multi_process, "load_model", must_not_load)
    argv = ["--tasks", "flash_mc", "essay_perplexity", "--model_name_or_path", str(tiny), "-f", "100000"]
    line = refused_before_evaluating(script, [*argv, "-o", str(tmp_path / "out.json")], capsys, monkeypatch)
    assert line == (
        "run_lm_eval.py: error: -f/--num_fewshot 100000: more few-shot examples than the tasks hold (flash_mc has "
        "20, essay_perplexity has 11); pass 11 or fewer, or leave it out for each task's own number."
    )


def test_the_few_shot_bound_is_each_tasks_own_count(tmp_path):
    pools = fewshot_pools(check_task_data(select_tasks(["flash_mc"], None)))
    assert pools == [FewshotPool("flash_mc", 20)]  # its 20 train items; the 250 test items are evaluated
    assert check_num_fewshot(20, pools) == [] and check_num_fewshot(None, pools) == []
    with pytest.raises(ValueError, match=r"-f/--num_fewshot 21: .*\(flash_mc has 20\); pass 20 or fewer"):
        check_num_fewshot(21, pools)
    # Few-shot examples drawn from the evaluated split: lm-eval leaves the evaluated document out, so 4 rows give 3.
    folder = write_user_task(tmp_path / "tasks")
    (folder / "my_sums.yaml").write_text((folder / "my_sums.yaml").read_text() + "fewshot_split: test\n")
    assert fewshot_pools(check_task_data(select_tasks(["my_sums"], [str(folder)]))) == [FewshotPool("my_sums", 3)]
    zero = FewshotPool("fixed", 0, fixed_at_zero=True)
    assert check_num_fewshot(5, [zero]) == [
        "-f/--num_fewshot 5: fixed sets num_fewshot: 0 in its YAML file, which lm-eval keeps: its prompts get no "
        "examples."
    ]
    unknown = [FewshotPool("custom", None)]
    check_num_fewshot(100000, unknown)  # not known before the run: bounded by the model's context instead
    check_num_fewshot_fits(128, unknown, 128)
    with pytest.raises(ValueError, match="-f/--num_fewshot 129: custom cannot count .* 128-token context"):
        check_num_fewshot_fits(129, unknown, 128)


# A rotary embedding whose frequencies follow the longest position once past the model's length.
ROPE_SCALING = {"dynamic": {"rope_type": "dynamic", "factor": 2.0}}


@pytest.mark.parametrize(
    "model_type, rope", [("gpt2", None), ("llama", "dynamic")], ids=["learned positions", "dynamic rotary"]
)
def test_buckets_past_the_models_length_or_a_rope_threshold_keep_the_scores(
    script, tmp_path, capsys, model_type, rope
):
    """A bucket past the model's length: GPT-2's position table ended there (IndexError), and rotary embeddings that
    follow the longest position rescaled every real token's (other scores). Buckets stop at the length, with one
    note."""
    checkpoint = save_tiny_checkpoint(tmp_path / model_type, model_type=model_type, max_position_embeddings=128)
    if rope is not None:
        config = json.loads((checkpoint / "config.json").read_text())
        theta = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
        config["rope_parameters"] = {**ROPE_SCALING[rope], "rope_theta": theta}
        (checkpoint / "config.json").write_text(json.dumps(config))
    base = ["--tasks", "essay_perplexity", "-L", "2", "--model_name_or_path", str(checkpoint), "--use_flash_attention"]
    plain, _ = evaluate(script, base, tmp_path / "plain.json")
    capsys.readouterr()
    padded, calls = evaluate(script, [*base, "--buckets", "16", "100", "300"], tmp_path / "padded.json")
    assert "buckets 300 exceed the max length 128: batches pad to it at most." in capsys.readouterr().out
    assert {shape[2] for _, shape in calls} <= {16, 100, 128}
    assert_same_scores_of(plain, padded, "essay_perplexity")


def test_bucket_padding_keeps_a_longrope_batch_below_its_original_length():
    """Phi-3's longrope switches its frequencies once the longest position passes the original length (here 24):
    a 10-token batch padded to a 64-token bucket would have crossed it. That length is a bucket too, so the real
    tokens' logits are the unpadded batch's."""
    from optimum.habana import gaudi_model_class
    from optimum.habana.cli.evaluation.lm_eval.model import EvalOptions, GaudiEvalLM
    from tests.helpers import tiny_config, train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(chat_template=False)
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8, "rope_theta": 10000.0}
    lengths = {"max_position_embeddings": 128, "original_max_position_embeddings": 24}
    config = tiny_config("phi3", vocab_size=len(tokenizer), rope_parameters=rope, **lengths)
    torch.manual_seed(0)
    model = gaudi_model_class("phi3")(config).eval()
    inputs = torch.randint(3, len(tokenizer), (2, 10))
    flags = {"use_flash_attention": True}
    plain = GaudiEvalLM(model, tokenizer, EvalOptions(attention=flags))._model_call(inputs)
    lm = GaudiEvalLM(model, tokenizer, EvalOptions(attention=flags, buckets=(64,)))
    assert lm.buckets.sizes == [24, 64]
    padded = lm._model_call(inputs)
    torch.testing.assert_close(padded, plain)


def test_results_file_that_appears_during_the_run_is_kept(tmp_path):
    """The output file is checked before the run; one that appears meanwhile (another evaluation with the same -o)
    is kept without --overwrite, and these results take the first free name beside it."""
    from optimum.habana.cli.evaluation.lm_eval.harness import write_results

    output = tmp_path / "results.json"
    output.write_text("another evaluation's")
    (tmp_path / "results-1.json").write_text("and a third")
    written = write_results(output, {"results": {}})
    assert written == tmp_path / "results-2.json" and json.loads(written.read_text()) == {"results": {}}
    assert output.read_text() == "another evaluation's" and (tmp_path / "results-1.json").read_text() == "and a third"
    assert write_results(output, {"results": {"x": 1}}, overwrite=True) == output
    assert json.loads(output.read_text()) == {"results": {"x": 1}}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["results-1.json", "results-2.json", "results.json"]


def test_a_run_refused_after_the_output_check_leaves_no_folder_behind(script, tiny, tmp_path, capsys):
    """-o in a folder still to make: the folder is made when the results are written, not when the path is checked,
    so a run refused later (an unknown task) leaves nothing behind."""
    output = tmp_path / "new" / "deeper" / "results.json"
    with pytest.raises(SystemExit) as raised:
        script.main(["--tasks", "no_such_task", "--model_name_or_path", str(tiny), "-o", str(output)])
    assert raised.value.code == 2 and "no_such_task" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    results, _ = evaluate(script, ["--tasks", "flash_mc", "-L", "1", "--model_name_or_path", str(tiny)], output)
    assert "flash_mc" in results["results"]


def test_a_generate_until_batch_of_empty_prompts_is_refused_with_or_without_buckets(tiny):
    """Stock HFLM fails inside generate() on a batch of empty prompts; with buckets the batch was padded and continued
    from padding alone, and scored."""
    from optimum.habana import gaudi_model_class
    from optimum.habana.cli.evaluation.lm_eval.model import EvalOptions, GaudiEvalLM

    model = gaudi_model_class("llama").from_pretrained(tiny)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    for buckets in ((), (8,)):
        lm = GaudiEvalLM(model, tokenizer, EvalOptions(attention={"use_flash_attention": True}, buckets=buckets))
        with pytest.raises(ValueError, match="generate_until requests with empty prompts"):
            lm._model_generate(torch.zeros((2, 0), dtype=torch.long), max_length=4, stop=["\n"])
