"""Smoke test of examples/text-generation/attention_fidelity.py: a tiny grid and a tiny random Llama.

It checks the JSON keys and rows, the Markdown written beside it, that the float64 reference is exact (an fp64 run
of the paths lands within 1e-12 of it, and it equals PyTorch's own float64 attention), that the default path's
blocks of query rows give its single call bitwise, and that bad option values exit 2 naming the flag. No timing
assertions.
"""

import contextlib
import io
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from optimum.habana.cli.evaluation.fidelity.attention import DEFAULT, call_path, reference_attention
from optimum.habana.utils.atomic import atomic_write_text
from tests.generation.support import UNSUPPORTED_FAMILY_REFUSAL, save_unsupported_family_config
from tests.helpers import ROOT, load_script, save_tiny_checkpoint


SCRIPT = ROOT / "examples" / "text-generation" / "attention_fidelity.py"
TINY_GRID = (
    "--seq_lens 48 96 --head_dims 16 32 --gqa 1 4 --geometry_seq_lens 64 --padded_seq_lens 64 "
    "--base_head_dim 16 --base_gqa 4 --dtypes fp32 bf16 fp64 --threads 1"
)
TINY_MODEL_PART = "--logit_lens 32 64 --ppl_window 64 --ppl_tokens 192"


@pytest.fixture(scope="module")
def script():
    return load_script("examples/text-generation/attention_fidelity.py")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def smoke_run(script, checkpoint, tmp_path_factory) -> tuple[dict, str, str]:
    """One run of the tiny grid and the tiny model: results.json, results.md and what it printed."""
    output_dir = tmp_path_factory.mktemp("fidelity")
    argv = [
        *f"{TINY_GRID} {TINY_MODEL_PART}".split(),
        "--model_name_or_path",
        str(checkpoint),
        "--output_dir",
        str(output_dir),
    ]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert script.main(argv) == 0
    report = json.loads((output_dir / "results.json").read_text())
    return report, (output_dir / "results.md").read_text(), printed.getvalue()


def test_json_has_a_row_per_cell_and_every_path(smoke_run):
    report, _, _ = smoke_run
    assert report["complete"] is True
    assert {
        "command",
        "arguments",
        "device",
        "hardware",
        "versions",
        "attention",
        "model",
        "targets",
        "seconds",
    } <= set(report)
    assert report["device"] == "cpu"
    sweeps = [(row["sweep"], row["dtype"], row["seq_len"], row["head_dim"], row["gqa"]) for row in report["attention"]]
    expected = [("lengths", dtype, n, 16, 4) for n in (48, 96) for dtype in ("fp32", "bf16", "fp64")]
    expected += [("geometry", dtype, 64, d, g) for d in (16, 32) for g in (1, 4) for dtype in ("fp32", "bf16", "fp64")]
    expected += [("padded", dtype, 64, 16, 4) for dtype in ("fp32", "bf16", "fp64")]
    assert sweeps == expected
    for row in report["attention"]:
        assert row["query_heads"] == max(2, row["gqa"]) and row["query_heads"] // row["kv_heads"] == row["gqa"]
        assert row["real_lengths"] == ([64, 48] if row["sweep"] == "padded" else [row["seq_len"]])
        paths = row["paths"]
        assert paths["fused_fast_softmax"] == {"status": "n/a", "reason": "n/a on cpu"}
        assert (paths["default_attn_softmax_bf16"]["status"] == "n/a") == (row["dtype"] == "fp32")
        for path in ("default", "fused"):
            assert paths[path]["status"] == "ok" and 0 <= paths[path]["mean_abs_error"] <= paths[path]["max_abs_error"]
            bound = {"fp32": 1e-5, "bf16": 0.05, "fp64": 1e-5}[row["dtype"]]
            assert paths[path]["max_abs_error"] < bound


def test_fp64_runs_of_our_paths_land_on_the_reference(smoke_run):
    """The reference is exact: in float64 the fused kernel and the default path with its softmax in the model dtype
    are within 1e-12 of it; the default path without the flag keeps its fp32 softmax, so it is only ~1e-7 close."""
    report, _, _ = smoke_run
    for row in (row for row in report["attention"] if row["dtype"] == "fp64"):
        assert row["paths"]["fused"]["max_abs_error"] < 1e-12
        assert row["paths"]["default_attn_softmax_bf16"]["max_abs_error"] < 1e-12
        assert 1e-12 < row["paths"]["default"]["max_abs_error"] < 1e-5
    assert report["model"]["reference_norms"] == {"rms_norms_in_float64": 5, "norm_classes_kept": []}
    check = report["model"]["reference_check"]
    assert check["fp64_fused"]["max_abs_error"] < 1e-10
    assert check["fp64_default_fp32_softmax"]["max_abs_error"] > check["fp64_fused"]["max_abs_error"]


def test_model_part_logits_and_perplexity(smoke_run):
    report, _, _ = smoke_run
    model = report["model"]
    assert [(s["start"], s["length"]) for s in model["segments"]] == [(0, 32), (0, 64), (64, 64), (128, 64)]
    for segment in model["segments"]:
        assert set(segment["dtypes"]) == {"fp32", "bf16", "fp64"}
        for paths in segment["dtypes"].values():
            assert paths["fused_fast_softmax"]["reason"] == "n/a on cpu"
            assert paths["default"]["status"] == paths["fused"]["status"] == "ok"
        # A float64 model as users load it still computes its RMSNorms in fp32; the reference does not.
        assert segment["dtypes"]["fp64"]["fused"]["max_abs_error"] < 1e-5
    perplexity = model["perplexity"]
    assert perplexity["predicted_tokens"] == 3 * 63 and perplexity["windows"] == 3
    values = perplexity["perplexity"]
    assert values["fp32"]["default"] == pytest.approx(values["reference"], rel=1e-5)
    assert values["fp32"]["fused"] == pytest.approx(values["fp32"]["default"], rel=1e-5)
    assert values["bf16"]["fused_fast_softmax"] == "n/a on cpu"
    errors = perplexity["change_standard_error"]
    assert set(errors) == {"fp32", "bf16", "fp64"} and all(set(value) == {"fused"} for value in errors.values())
    assert 0 <= errors["fp32"]["fused"] < errors["bf16"]["fused"]
    assert report["targets"]["perplexity_bf16"]["standard_error"] == errors["bf16"]["fused"]
    assert {"attention_error_ratio", "logits_error_ratio", "perplexity_fp32", "perplexity_bf16"} <= set(
        report["targets"]
    )


def test_markdown_is_written_and_printed(smoke_run):
    report, written, printed = smoke_run
    assert printed.strip() == written.strip()
    assert report["command"] in written
    for heading in ("### Sequence length", "### Head dim x GQA ratio", "### Left-padded batch", "## Model logits"):
        assert heading in written
    assert "## Perplexity on long_prompt.txt" in written and "## Targets" in written
    assert "n/a on cpu" in written and "n/a (fp32" in written
    header = next(line for line in written.splitlines() if line.startswith("| dtype") and "GQA" in line)
    assert "fused max / mean" in header and "default + attn_softmax_bf16" in header


def test_reference_equals_pytorch_float64_attention_over_real_tokens():
    """Blocked, padded and grouped: the reference against PyTorch's float64 math attention with the full mask."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, heads, 40, 8, generator=generator) for heads in (4, 2, 2))
    lengths = [40, 29]
    reference = reference_attention(query, key, value, lengths, 0.3, block_bytes=8 * 4 * 40 * 3)  # 3-row blocks
    positions = torch.arange(40)
    real = positions[None] >= (40 - torch.tensor(lengths))[:, None]
    mask = (positions[None, :] <= positions[:, None])[None] & real[:, None, :]
    expected = F.scaled_dot_product_attention(
        query.double(), key.double(), value.double(), attn_mask=mask[:, None], scale=0.3, enable_gqa=True
    ).transpose(1, 2)
    for row, length in enumerate(lengths):
        torch.testing.assert_close(reference[row, 40 - length :], expected[row, 40 - length :], atol=1e-12, rtol=0)
        assert (reference[row, : 40 - length] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_default_path_in_blocks_of_rows_is_bitwise_its_single_call(padded, dtype):
    """What the grid does at 8k and 16k tokens (blocks of 2048 rows), at a size a test affords: 4 blocks of 64."""
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(2, heads, 256, 64, generator=generator).to(dtype) for heads in (4, 1, 1))
    lengths = [256, 192] if padded else [256, 256]
    single, calls = call_path(DEFAULT, query, key, value, lengths, 0.125)
    blocked, blocks = call_path(DEFAULT, query, key, value, lengths, 0.125, score_block_bytes=2 * 4 * 256 * 4 * 64)
    assert (calls, blocks) == (1, 4)
    assert torch.equal(single, blocked)


def bad_values(tmp_path: Path, checkpoint: Path) -> list[tuple[list[str], str]]:
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "results.json").write_text("{}")
    model = ["--model_name_or_path", str(checkpoint)]
    cases = [
        (["--seq_lens", "0"], "--seq_lens"),
        (["--seq_lens", "many"], "--seq_lens"),
        (["--gqa", "-2"], "--gqa"),
        (["--head_dims", "0"], "--head_dims"),
        (["--base_gqa", "0"], "--base_gqa"),
        (["--padded_seq_lens", "3"], "--padded_seq_lens"),
        (["--dtypes", "fp16"], "--dtypes"),
        (["--parts", "everything"], "--parts"),
        (["--ppl_tokens", "-1"], "--ppl_tokens"),
        (["--threads", "0"], "--threads"),
        (["--device", "tpu"], "--device"),
        (["--text_file", str(tmp_path / "missing.txt")], "--text_file"),
        (["--output_dir", str(existing)], "--output_dir"),
        ([*model, "--logit_lens", "4096"], "--logit_lens"),
        ([*model, "--logit_lens", "32", "--ppl_window", "1000"], "--ppl_window"),
        (["--model_name_or_path", str(tmp_path / "no_such_model")], "--model_name_or_path"),
        (
            ["--model_name_or_path", str(save_unsupported_family_config(tmp_path / "stablelm"))],
            UNSUPPORTED_FAMILY_REFUSAL,
        ),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "--device cuda"))
    return cases


def test_bad_values_exit_2_naming_the_flag(script, checkpoint, tmp_path, capsys):
    for argv, flag in bad_values(tmp_path, checkpoint):
        with pytest.raises(SystemExit) as exit_info:
            script.main(argv)
        assert exit_info.value.code == 2, argv
        assert flag in capsys.readouterr().err, argv


def test_ctrl_c_is_one_line_and_leaves_the_measurements_so_far_marked_incomplete(
    script, checkpoint, tmp_path, capsys, monkeypatch
):
    from optimum.habana.cli.evaluation.fidelity import command

    measure_grid = command.measure_grid

    def interrupted_after_the_first_cells(grid, device, seed, add_record):
        def add_then_stop(record):
            add_record(record)
            raise KeyboardInterrupt

        measure_grid(grid, device, seed, add_then_stop)

    monkeypatch.setattr(command, "measure_grid", interrupted_after_the_first_cells)
    argv = [*TINY_GRID.split(), "--parts", "attention", "--output_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()  # a progress line per cell, then the one line
    assert "Traceback" not in "".join(err) and err[-1:] == [
        f"attention_fidelity.py: interrupted: the measurements so far are in {tmp_path / 'results.json'}, "
        f"{tmp_path / 'results.md'}, marked incomplete."
    ]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["complete"] is False and len(report["attention"]) == 1
    assert "INCOMPLETE" in (tmp_path / "results.md").read_text()


@pytest.fixture
def sigterm_guard():
    """A SIGTERM handler of the test's own, so that a run which leaves SIGTERM alone is not killed with the test
    process; the script must put it back when it ends."""
    received = []

    def guard(number, frame):
        received.append(number)

    previous = signal.signal(signal.SIGTERM, guard)
    yield received
    assert signal.getsignal(signal.SIGTERM) is guard  # the script put it back
    signal.signal(signal.SIGTERM, previous)


def stopping_grid(monkeypatch, stop: Callable[[], None], after: int = 1) -> None:
    """measure_grid, calling `stop` once `after` measurements are recorded (before any with `after` 0)."""
    from optimum.habana.cli.evaluation.fidelity import command

    measure_grid = command.measure_grid

    def grid_then_stop(grid, device, seed, add_record):
        recorded = []

        def add(record):
            add_record(record)
            recorded.append(record)
            if len(recorded) == after:
                stop()

        if after == 0:
            stop()
        measure_grid(grid, device, seed, add)

    monkeypatch.setattr(command, "measure_grid", grid_then_stop)


def stopped_run(script, tmp_path, capsys, status: int, *extra: str) -> tuple[str, dict]:
    """main() of the tiny attention grid into tmp_path, stopped: its exit status, last line and results.json."""
    argv = [*TINY_GRID.split(), "--parts", "attention", "--output_dir", str(tmp_path), *extra]
    try:
        with pytest.raises(SystemExit) as exit_info:
            script.main(argv)
    except KeyboardInterrupt:  # would end the whole test session
        pytest.fail("a Ctrl-C escaped the script: a traceback, not its one line")
    err = capsys.readouterr().err
    assert exit_info.value.code == status and "Traceback" not in err
    return err.strip().splitlines()[-1], json.loads((tmp_path / "results.json").read_text())


def send(number: int) -> Callable[[], None]:
    return lambda: os.kill(os.getpid(), number)


def files_of(folder: Path) -> str:
    return f"{folder / 'results.json'}, {folder / 'results.md'}"


def test_sigterm_is_one_line_exit_143_and_leaves_the_measurements_marked_incomplete(
    script, tmp_path, capsys, monkeypatch, sigterm_guard
):
    stopping_grid(monkeypatch, send(signal.SIGTERM))
    line, report = stopped_run(script, tmp_path, capsys, 143)
    assert line == (
        f"attention_fidelity.py: terminated (SIGTERM): the measurements so far are in {files_of(tmp_path)}, "
        "marked incomplete."
    )
    assert report["complete"] is False and len(report["attention"]) == 1 and not sigterm_guard
    assert "INCOMPLETE" in (tmp_path / "results.md").read_text()


def test_an_earlier_complete_run_never_stands_for_one_stopped_before_its_first_measurement(
    script, tmp_path, capsys, monkeypatch, sigterm_guard
):
    (tmp_path / "results.json").write_text(json.dumps({"complete": True, "attention": [{"earlier": 1}]}))
    (tmp_path / "results.md").write_text("# Attention fidelity (earlier, complete)\n")
    stopping_grid(monkeypatch, send(signal.SIGTERM), after=0)
    line, report = stopped_run(script, tmp_path, capsys, 143, "--overwrite")
    assert report["complete"] is False and report["attention"] == [] and not sigterm_guard
    assert "INCOMPLETE" in (tmp_path / "results.md").read_text()
    assert line.endswith(f"the measurements so far are in {files_of(tmp_path)}, marked incomplete.")


class CtrlCWhileWriting:
    """sys.stderr, sending a second Ctrl-C while the script writes its interrupted line."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        if "interrupted:" in text:
            os.kill(os.getpid(), signal.SIGINT)
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def test_a_second_ctrl_c_during_the_handler_still_ends_in_the_one_line(script, tmp_path, capsys, monkeypatch):
    from optimum.habana.cli.evaluation.fidelity import command, report

    stopped = []

    def results_json_only(output_dir, results):  # Ctrl-C between the two files, once: results.md lags behind
        if results.get("attention") and not stopped:
            stopped.append(True)
            atomic_write_text(output_dir / "results.json", json.dumps(results))
            raise KeyboardInterrupt
        return report.write_report(output_dir, results)

    monkeypatch.setattr(command, "write_report", results_json_only)
    monkeypatch.setattr(sys, "stderr", CtrlCWhileWriting(sys.stderr))
    line, results = stopped_run(script, tmp_path, capsys, 130)
    assert line == (
        f"attention_fidelity.py: interrupted: the measurements so far are in {files_of(tmp_path)}, marked incomplete."
    )
    assert results["complete"] is False and len(results["attention"]) == 1
    assert (tmp_path / "results.md").read_text() == report.markdown(results)  # written again, with the measurement


def test_a_signal_during_the_final_write_waits_until_both_files_say_complete(
    script, tmp_path, capsys, monkeypatch, sigterm_guard
):
    from optimum.habana.cli.evaluation.fidelity import command, report

    def signalled_when_complete(output_dir, results):
        if results["complete"]:
            os.kill(os.getpid(), signal.SIGTERM)
        return report.write_report(output_dir, results)

    monkeypatch.setattr(command, "write_report", signalled_when_complete)
    line, results = stopped_run(script, tmp_path, capsys, 143)
    assert line == (
        f"attention_fidelity.py: terminated (SIGTERM): the run had finished: the complete results are in "
        f"{files_of(tmp_path)}."
    )
    assert results["complete"] is True and "INCOMPLETE" not in (tmp_path / "results.md").read_text()
