"""benchmark_long_context_decode.py: the paths side by side from one prefilled cache, shrunk to a one-layer synthetic
model and short contexts (the table's columns and the paths' tokens, not its timings, are what a test can check)."""

import pytest
import torch

from optimum.habana.kernels import cpu_decode, split_context
from tests.helpers import count_context_cuts, count_decode_kernel_calls, load_script, record_absorbed_rows


SCRIPT = "examples/text-generation/benchmark_long_context_decode.py"
SMALL = ["--model_name_or_path", "smollm2-attn", "--preset_layers", "1", "--preset_intermediate_size", "64"]


def table_rows(out: str) -> list[list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_every_path_decodes_the_same_tokens_from_the_same_cache(capsys):
    script = load_script(SCRIPT)
    argv = [*SMALL, "--shapes", "1x96", "2x80", "--steps", "2", "--rounds", "1", "--no-random_cache"]
    assert script.main([*argv, "--profile", "flag"]) == 0
    out = capsys.readouterr().out
    assert "read rate of a batch-1 linear layer" in out and "cache prefilled" in out
    header, *rows = table_rows(out)
    assert header[:3] == ["batch x context", "path", "step [ms]"]
    for column in ("vs stock", "context cost [ms]", "KV read once [ms]", "cost / KV read", "bound tok/s"):
        assert column in header
    assert "cache held / needed [MiB]" in header and "step peak [MiB]" in header
    measured = [row for row in rows if row[0] in ("1 x 96", "2 x 80")]
    assert [row[1] for row in measured] == ["flag", "default", "stock sdpa", "stock eager"] * 2
    assert all(row[-1] == "same" for row in measured)  # greedy tokens equal to the default path's, every path
    stock_columns = {row[1]: row[header.index("vs stock")] for row in measured}
    assert stock_columns["stock sdpa"] == "-" and stock_columns["flag"] != "-"
    assert "flag, 1 x 96 (random cache), per step under torch.profiler:" in out
    assert "the whole step (wall clock)" in out and "outside any operator (Python)" in out


def test_every_path_runs_in_the_dtype_asked_for(capsys, monkeypatch):
    """`--dtype bfloat16`: every path's model, its cache and the read probe in bfloat16, as the header says."""
    script = load_script(SCRIPT)
    built, decode_paths = [], script.decode_paths

    def recorded_paths(*args, **kwargs):
        built.extend(decode_paths(*args, **kwargs))
        return built

    monkeypatch.setattr(script, "decode_paths", recorded_paths)
    argv = [*SMALL, "--shapes", "1x96", "--steps", "2", "--rounds", "1", "--dtype", "bfloat16"]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert ", bfloat16, " in out and "keys and values 768 bytes a token" in out  # fp32: 1,536 (3 heads of 64, K+V)
    assert {parameter.dtype for path in built for parameter in path.model.parameters()} == {torch.bfloat16}
    assert [row[1] for row in table_rows(out) if row[0] == "1 x 96"] == [
        "flag",
        "default",
        "stock sdpa",
        "stock eager",
    ]


def test_the_pytorch_kernel_and_whole_context_rows_are_the_flag_without_the_kernel_and_the_cut(capsys, monkeypatch):
    """Two threads over SmolLM2's three key/value heads, cut whenever they would idle: the flag's one-sequence decode
    steps run on the decode kernel, the PyTorch-kernel row's are cut in two, the whole-context row's are neither,
    and every row gives the default path's tokens."""
    monkeypatch.setattr(split_context, "MIN_PIECE_TOKENS", 16)
    monkeypatch.setattr(split_context, "MAX_THREAD_USE", 1.0)
    cuts = count_context_cuts(monkeypatch)
    kernel_calls = count_decode_kernel_calls(monkeypatch)
    threads = torch.get_num_threads()
    argv = [*SMALL, "--shapes", "1x96", "--steps", "2", "--rounds", "1", "--no-random_cache", "--threads", "2"]
    try:
        assert load_script(SCRIPT).main([*argv, "--pytorch_kernel", "--whole_context"]) == 0
    finally:
        torch.set_num_threads(threads)
    header, *rows = table_rows(capsys.readouterr().out)
    measured = [row for row in rows if row[0] == "1 x 96"]
    paths = ["flag", "flag, PyTorch kernel", "flag, whole context", "default", "stock sdpa", "stock eager"]
    assert [row[1] for row in measured] == paths
    assert all(row[-1] == "same" for row in measured)
    assert measured[1][header.index("vs stock")] != "-" and measured[2][header.index("vs stock")] != "-"
    # Each row: 2 steps at the context, 2 at 64 tokens, 2 for the memory column, one layer each.
    assert cuts == {2: 6}
    if cpu_decode.environment_problem() is None:
        assert kernel_calls == {3: 6}  # the query group of 3 as rows


def test_latent_attention_rows_read_the_compressed_cache_and_give_its_products_floor(capsys, monkeypatch):
    """DeepSeek-V2-Lite's geometry, one layer, a random compressed cache: the flag's decode steps attend over it
    (kernels/latent.py), the table adds the products' floor, and every path gives the default path's tokens."""
    absorbed_rows = record_absorbed_rows(monkeypatch)
    argv = ["--model_name_or_path", "deepseek-v2-lite-attn", "--preset_layers", "1", "--preset_intermediate_size"]
    assert load_script(SCRIPT).main([*argv, "64", "--shapes", "1x96", "--steps", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "keys and values 2,304 bytes a token; cache random" in out  # (512 + 64) float32 numbers, one layer
    header, *rows = table_rows(out)
    assert "products floor [ms]" in header and "cost / floor" in header
    measured = [row for row in rows if row[0] == "1 x 96"]
    assert [row[1] for row in measured] == ["flag", "default", "stock sdpa", "stock eager"]
    assert all(row[-1] == "same" for row in measured)
    assert absorbed_rows and set(absorbed_rows) == {1}  # the flag's decode steps, one query row each


def test_the_continuous_batching_rows_serve_the_same_prompts_through_the_engine(capsys, monkeypatch):
    """The engine's rows decode the other rows' prompts to the default path's tokens; the flag's decode rows read the
    paged cache in place on one row and never on the engine's-gather row (its steps: 3 at the context and 3 at 64
    tokens, one kernel call each for both requests; the first token comes from the prompt)."""
    from optimum.habana.cli.benchmarks import paged_decode
    from optimum.habana.transformers import paged_attention

    in_place: list[int] = []
    attend = paged_attention.paged_decode_sdpa
    monkeypatch.setattr(
        paged_attention, "paged_decode_sdpa", lambda query, *a, **k: in_place.append(1) or attend(query, *a, **k)
    )
    argv = [*SMALL, "--shapes", "2x96", "--steps", "3", "--rounds", "1", "--continuous_batching"]
    assert load_script(SCRIPT).main(argv) == 0
    header, *rows = table_rows(capsys.readouterr().out)
    measured = {row[1]: row for row in rows if row[0] == "2 x 96"}
    engine_rows = [paged_decode.IN_PLACE, paged_decode.GATHERED, paged_decode.STOCK]
    assert list(measured) == ["flag", "default", "stock sdpa", "stock eager", *engine_rows]
    assert all(row[-1] == "same" for row in measured.values())
    assert measured[paged_decode.IN_PLACE][header.index("vs stock")] != "-"
    assert measured[paged_decode.STOCK][header.index("cache held / needed [MiB]")] == "-"
    if cpu_decode.environment_problem() is None:
        assert len(in_place) == 2 * 3  # the in-place row's decode steps, one layer; none on the gather's row


def test_the_engine_rows_raise_the_models_positions_only_where_rope_does_not_read_them():
    """The engine refuses a prompt past max_position_embeddings, which the dense rows decode past: raised for the run
    (and said) under default RoPE; under a RoPE that reads it, an error naming the longest context that fits."""
    from transformers import LlamaConfig

    from optimum.habana.cli.benchmarks.paged_decode import check_positions

    model = torch.nn.Module()
    model.config = LlamaConfig(max_position_embeddings=128)
    assert check_positions(model, 100, 12) is None and model.config.max_position_embeddings == 128
    note = check_positions(model, 128, 12)
    assert "raised from 128 to 141" in note and model.config.max_position_embeddings == 141
    model.config = LlamaConfig(
        max_position_embeddings=128, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    with pytest.raises(ValueError, match="its dynamic RoPE depends on that value: use contexts of at most 115 tokens"):
        check_positions(model, 128, 12)
    assert model.config.max_position_embeddings == 128


def test_continuous_batching_rows_need_real_prompts():
    with pytest.raises(SystemExit) as exit_info:
        load_script(SCRIPT).main([*SMALL, "--continuous_batching", "--random_cache"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    "argv", [["--shapes", "1x32"], ["--shapes", "0x512"], ["--steps", "0"], ["--profile", "x"], ["--dtype", "float64"]]
)
def test_bad_arguments_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exit_info:
        load_script(SCRIPT).main(argv)
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "cuda_visible", "words"),
    [
        (["--threads", "0"], False, "--threads must be at least 1, got 0"),
        (["--threads", "-1"], False, "--threads must be at least 1, got -1"),
        (
            ["--model_name_or_path", "gpt-oss-20-attn"],
            False,
            "did you mean 'gpt-oss-20b-attn'? The presets are llama2-7b-attn",
        ),
        (["--model_name_or_path", "missing/folder/"], False, "The path 'missing/folder/' does not exist"),
        (["--device", "cuda"], False, "--device cuda: PyTorch sees no CUDA device here"),
        (
            ["--device", "cuda", "--pytorch_kernel"],
            True,
            "--pytorch_kernel and --whole_context compare the CPU decode kernel and its context cut: drop them",
        ),
        (["--device", "cuda", "--profile", "flag"], True, "--profile reads the CPU's operators"),
    ],
)
def test_threads_devices_and_model_names_are_checked_before_anything_loads(
    argv, cuda_visible, words, capsys, monkeypatch
):
    from optimum.habana.cli.benchmarks import long_context_decode

    def nothing_loads(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(long_context_decode, "build_model", nothing_loads)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_visible)
    with pytest.raises(SystemExit) as exit_info:
        load_script(SCRIPT).main(argv)
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def test_a_context_cost_within_the_rounds_spread_is_printed_as_noise(capsys, monkeypatch):
    """A context cost the rounds' spread covers (here: every step at the context made faster than at 64 tokens) is
    printed as noise with its size, and its ratio to the KV read as "-": never a negative cost."""
    from optimum.habana.cli.benchmarks import long_context_decode

    measure = long_context_decode.measure_shape

    def faster_at_the_context(*args, **kwargs):
        timings = measure(*args, **kwargs)
        for timing in timings.values():
            timing.round_costs = [-step / 2 for step in timing.base_steps]
        return timings

    script = load_script(SCRIPT)
    monkeypatch.setattr(script, "measure_shape", faster_at_the_context)
    argv = [*SMALL, "--shapes", "1x96", "--steps", "2", "--rounds", "2", "--no-random_cache"]
    assert script.main(argv) == 0
    header, *rows = table_rows(capsys.readouterr().out)
    for row in rows:
        assert row[header.index("context cost [ms]")].startswith("below noise (")
        assert row[header.index("cost / KV read")] == "-"
    timing = long_context_decode.PathTiming(round_costs=[0.006, 0.0065, 0.007])
    assert timing.context_cost == pytest.approx(0.0065) and timing.noise == pytest.approx(0.001)
    assert timing.context_cost_measured
    assert not long_context_decode.PathTiming(round_costs=[0.001, 0.004]).context_cost_measured


def test_each_rounds_context_cost_pairs_steps_taken_side_by_side(monkeypatch):
    """A machine that slows down between rounds moves both steps of a pair: the context cost stays the pairs'
    difference. Timed by a fake clock: 1 s a step at the context, 0.25 s at 64 tokens, 10 s more from the second
    round on (two steps of each per round)."""

    calls = []

    def step(path, cache, token):
        calls.append(cache.length)
        slower = 10.0 if len(calls) > 4 else 0.0  # the second round's steps and after
        return (1.0 if cache.length > 64 else 0.25) + slower, token

    timing = measured_on_a_fake_clock(monkeypatch, step)
    assert calls == [96, 64] * 6  # in turn
    assert timing.round_costs == [0.75, 0.75, 0.75] and timing.context_cost_measured
    assert timing.long_steps == [
        1.0,
        11.0,
        11.0,
    ]  # a spread of 10 s, which the rounds' absolute steps would call noise


def test_each_rounds_cost_is_divided_by_the_same_rounds_read(monkeypatch):
    """The read the context cost is compared with is taken after each pair of steps, so that a machine whose memory
    slows down (here: everything twice as slow from the second round on) moves the cost and its read alike: each
    round's cost over its own read, where a read taken once before the rounds would double the ratio."""
    from optimum.habana.cli.benchmarks import long_context_decode

    calls = []

    def slowdown() -> float:
        return 2.0 if sum(call == "read" for call in calls) >= 2 else 1.0  # after the first round's two pairs

    def step(path, cache, token):
        calls.append(cache.length)
        return (1.0 if cache.length > 64 else 0.25) * slowdown(), token

    class Probe:
        bytes = 1000

        def read_seconds(self) -> float:
            seconds = 0.05 * slowdown()
            calls.append("read")
            return seconds

    timing = measured_on_a_fake_clock(monkeypatch, step, probe=Probe(), kv_bytes=10_000)
    assert calls == [96, 64, "read"] * 6  # a read after each pair
    assert timing.round_costs == [0.75, 1.5, 1.5]
    assert timing.round_reads == pytest.approx([0.5, 1.0, 1.0])  # the probe's 1000 bytes scaled to the cache's
    assert timing.cost_per_read == pytest.approx(1.5) and timing.kv_read == pytest.approx(1.0)
    assert timing.context_cost / timing.round_reads[0] == pytest.approx(3.0)  # against the first round's read alone
    uneven = long_context_decode.PathTiming(round_costs=[2.0, 6.0, 4.0], round_reads=[1.0, 3.0, 1.0])
    assert uneven.cost_per_read == pytest.approx(2.0)  # the median of the rounds' ratios, not of costs over reads


def measured_on_a_fake_clock(monkeypatch, step, **measure_kwargs):
    """`measure_shape`'s timing of one path over a 96-token cache, 3 rounds of 2 steps at each context, with `step`
    (the path, a stand-in cache of `FixedLength`, the token) as its decode step: no model runs."""
    from optimum.habana.cli.benchmarks import long_context_decode

    monkeypatch.setattr(long_context_decode, "one_step", step)
    monkeypatch.setattr(long_context_decode, "filled_cache", lambda path, kv, length, steps: FixedLength(length))
    monkeypatch.setattr(long_context_decode, "cache_bytes", lambda cache: 0)
    monkeypatch.setattr(long_context_decode, "step_peak_memory", lambda *args, **kwargs: 0)
    path = long_context_decode.DecodePath("flag", torch.nn.Linear(1, 1), {}, growing_cache=False)
    kv = [(torch.zeros(1, 1, 96, 1), torch.zeros(1, 1, 96, 1))]
    first_token = torch.zeros(1, 1, dtype=torch.long)
    return long_context_decode.measure_shape([path], kv, first_token, 2, 3, **measure_kwargs)["flag"]


class FixedLength:
    """A stand-in cache of `length` tokens, for the fake clock."""

    def __init__(self, length: int) -> None:
        self.length = length
