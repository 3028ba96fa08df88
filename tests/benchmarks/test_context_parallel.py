"""benchmark_context_parallel.py: its refusals, and its table and longest lengths from measured cells (the launches
themselves are the script's; a real run takes minutes, see docs/multi_device.md)."""

import pytest

from tests.helpers import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("examples/language-modeling/benchmark_context_parallel.py")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes", "2"], "--sizes 2: smollm2-attn has 9 heads, which 2 must divide."),
        (
            ["--model", "llama3-8b-attn", "--sizes", "4", "--tokens", "2"],
            "--tokens: every length must be at least the largest of --sizes (4).",
        ),
        (["--threads", "0", "--sizes", "1"], "--threads must be at least 1, got 0."),
        (["--memory_limit_gb", "-1", "--sizes", "1"], "--memory_limit_gb must be 0 (no cap) or more, got -1.0."),
        (["--timed_steps", "-1", "--sizes", "1"], "--timed_steps must be 0 (memory only) or more, got -1."),
    ],
)
def test_values_that_cannot_run_are_refused_in_one_line(script, capsys, argv, message):
    with pytest.raises(SystemExit) as stopped:
        script.main(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"benchmark_context_parallel.py: error: {message}\n"


def test_the_table_compares_each_split_with_one_process_and_names_the_longest_lengths(script):
    gib = 1024**3
    cells = [
        {"tokens": 2048, "size": 1, "status": "ok", "peak_memory_bytes": 3 * gib, "extra_memory_bytes": 2 * gib,
         "tokens_per_second": 50.0},
        {"tokens": 2048, "size": 2, "status": "ok", "peak_memory_bytes": 2 * gib, "extra_memory_bytes": 1 * gib,
         "tokens_per_second": 80.0},
        {"tokens": 4096, "size": 1, "status": "oom"},
        {"tokens": 4096, "size": 2, "status": "ok", "peak_memory_bytes": 3 * gib, "extra_memory_bytes": 2 * gib,
         "tokens_per_second": 70.0},
        {"tokens": 8192, "size": 1, "status": "ok", "peak_memory_bytes": 8 * gib, "extra_memory_bytes": 6 * gib,
         "tokens_per_second": None},  # --timed_steps 0: memory only
        {"tokens": 8192, "size": 2, "status": "ok", "peak_memory_bytes": 5 * gib, "extra_memory_bytes": 3 * gib,
         "tokens_per_second": None},
    ]  # fmt: skip
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in script.table(cells).splitlines()[2:]]
    assert rows[1] == ["2048", "2", "2.00", "1.00", "0.50", "0.67", "80.0"]
    assert rows[2] == ["4096", "1", "oom", "-", "-", "-", "-"]
    assert rows[3][4:6] == ["-", "-"]  # no one-process cell to compare with
    assert rows[5] == ["8192", "2", "5.00", "3.00", "0.50", "0.62", "-"]
    assert script.longest(cells, [1, 2]) == "- 1 process(es): 8192\n- 2 process(es): 8192"
