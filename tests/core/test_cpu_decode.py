"""The CPU decode kernel (`kernels/cpu_decode.c`): PyTorch's flash kernel's results for a decode step's shapes and
masks on any thread count, read from the cache in place, and stock's greedy tokens; the calls it takes and those it
leaves; built once per machine, atomically, and where it cannot be built, one warning and PyTorch's kernel."""

import os
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from optimum.habana.kernels import cpu_decode, cpu_decode_library, split_context
from optimum.habana.kernels.cpu_decode import cpu_decode_applies, cpu_decode_sdpa
from optimum.habana.kernels.dispatch import fused_sdpa
from optimum.habana.utils.staging import staging_path
from tests.helpers import (
    build_pair,
    count_decode_kernel_calls,
    decode_step_copies,
    left_padded_batch,
)


needs_kernel = pytest.mark.skipif(
    cpu_decode.environment_problem() is not None, reason=f"no decode kernel here: {cpu_decode.environment_problem()}"
)
GREEDY = {"do_sample": False, "pad_token_id": 0}


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """An empty cache folder and no kernel loaded yet in this process; afterwards the real cache folder again."""
    monkeypatch.setattr(cpu_decode_library, "cache_root", lambda: tmp_path)
    monkeypatch.delenv("CC", raising=False)
    for cached in (cpu_decode.decode_kernel, cpu_decode.environment_problem):
        cached.cache_clear()
    yield tmp_path / "kernels"
    for cached in (cpu_decode.decode_kernel, cpu_decode.environment_problem):
        cached.cache_clear()


def decode_inputs(batch: int, heads: int, rows: int, length: int, head_dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, rows, head_dim, generator=generator)
    # Views of a longer storage, as a cache's filled slots are.
    key, value = (torch.randn(batch, heads, length + 9, head_dim, generator=generator)[:, :, :length] for _ in "kv")
    return query, key, value


SHAPES = {
    "one sequence, a query group of 3 as rows": (1, 3, 3, 4099, 64),
    "a padded batch, one row per head": (4, 2, 1, 600, 64),
    "one cached token": (2, 2, 4, 1, 128),
    "heads of 256, a group of 8": (1, 1, 8, 3000, 256),
    "heads of 80": (2, 4, 2, 777, 80),
}


def masks(batch: int, heads: int, rows: int, length: int) -> dict[str, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(1)
    padding = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    padding[0, ..., : length // 2] = False  # the first sequence left-padded over half its context
    per_row = torch.rand(batch, heads, rows, length, generator=generator) > 0.4
    per_row[0, 0, 0] = False  # a row that may attend to nothing
    return {
        "none": None,
        "boolean padding": padding,
        "boolean per head and row": per_row,
        "additive -inf per head and row": torch.where(per_row, 0.0, -torch.inf),
        "additive finfo.min": torch.where(padding, 0.0, torch.finfo(torch.float32).min),
    }


@needs_kernel
@pytest.mark.parametrize("mask_name", list(masks(1, 1, 1, 2)))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_kernel_gives_pytorchs_flash_attention(shape, mask_name):
    batch, heads, rows, length, head_dim = SHAPES[shape]
    query, key, value = decode_inputs(batch, heads, rows, length, head_dim)
    mask = masks(batch, heads, rows, length)[mask_name]
    assert cpu_decode_applies(query, key, value, mask, is_causal=False, dropout_p=0.0)
    expected = F.scaled_dot_product_attention(query, key, value, mask)
    output = cpu_decode_sdpa(query, key, value, mask, scale=head_dim**-0.5)
    assert output.shape == expected.shape and output.dtype == torch.float32
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_every_remainder_of_the_kernels_register_blocks(rows, dtype):
    """The kernel computes in blocks: dot products 8 keys at a time over 8 floats of the head at a time, weighted sums
    4 rows at a time over 16 values of the head, then 8, then single floats. Heads of 44 (a remainder of 4 floats),
    values of 28 (a block of 16, one of 8, 4 floats), every row count of a group's last block, 1037 tokens (a
    remainder of keys and of values), a mask per row and sinks: against the attention written out."""
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(2, 2, rows, 44, generator=generator)
    key = torch.randn(2, 2, 1037, 44, generator=generator).to(dtype)
    value = torch.randn(2, 2, 1037, 28, generator=generator).to(dtype)
    mask = torch.rand(2, 2, rows, 1037, generator=generator) > 0.3
    sinks = torch.randn(2, rows, generator=generator)
    assert cpu_decode_applies(query.to(dtype), key, value, mask, is_causal=False, dropout_p=0.0, sinks=sinks)
    output = cpu_decode_sdpa(query.to(dtype), key, value, mask, scale=44**-0.5, sinks=sinks)
    scores = (query.to(dtype).double() @ key.double().transpose(-1, -2) * 44**-0.5).masked_fill(~mask, -torch.inf)
    with_sinks = torch.cat([scores, sinks.double().expand(2, 2, rows)[..., None]], dim=-1)  # a sink: a key of value 0
    expected = torch.softmax(with_sinks, dim=-1)[..., :-1] @ value.double()  # float64 throughout
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 2e-3}
    torch.testing.assert_close(output.double(), expected.to(dtype).double(), **tolerance)


@needs_kernel
@pytest.mark.parametrize("mask_name", ["none", "boolean padding", "additive -inf per head and row"])
@pytest.mark.parametrize("shape", ["one sequence, a query group of 3 as rows", "heads of 80"])
def test_a_bfloat16_cache_stays_within_one_rounding_of_pytorchs_kernel(shape, mask_name):
    """bfloat16 keys and values are widened as they are read; the arithmetic is float32, as in PyTorch's kernel."""
    batch, heads, rows, length, head_dim = SHAPES[shape]
    query, key, value = (tensor.bfloat16() for tensor in decode_inputs(batch, heads, rows, length, head_dim))
    mask = masks(batch, heads, rows, length)[mask_name]
    mask = mask if mask is None or mask.dtype == torch.bool else mask.bfloat16()
    assert cpu_decode_applies(query, key, value, mask, is_causal=False, dropout_p=0.0)
    expected = F.scaled_dot_product_attention(query, key, value, mask)
    output = cpu_decode_sdpa(query, key, value, mask, scale=head_dim**-0.5)
    assert output.dtype == torch.bfloat16
    torch.testing.assert_close(output, expected, rtol=1.6e-2, atol=2e-3)


@needs_kernel
def test_a_row_that_may_attend_to_nothing_is_zero_as_in_pytorchs_kernel():
    query, key, value = decode_inputs(2, 2, 3, 3000, 64)
    mask = torch.zeros(2, 1, 1, 3000, dtype=torch.bool)
    mask[1] = True
    expected = F.scaled_dot_product_attention(query, key, value, mask)
    assert expected[0].abs().max() == 0
    output = cpu_decode_sdpa(query, key, value, mask, scale=0.125)
    assert output[0].abs().max() == 0
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("thread_count", [1, 2, 3])
@pytest.mark.parametrize("length", [300, 8193])  # one chunk a head, or chunks and a short last one
def test_any_thread_count_gives_the_same_attention(threads, thread_count, length):
    threads(thread_count)
    query, key, value = decode_inputs(1, 3, 3, length, 64)
    expected = F.scaled_dot_product_attention(query, key, value)
    torch.testing.assert_close(cpu_decode_sdpa(query, key, value, None, scale=0.125), expected, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_fused_sdpa_runs_a_grouped_decode_step_on_the_kernel(monkeypatch):
    """Nine query heads over three key/value heads, one new token: the query group becomes three rows of its head."""
    calls = count_decode_kernel_calls(monkeypatch)
    query, key, value = decode_inputs(1, 3, 3, 2000, 64)
    query = query.reshape(1, 9, 1, 64)
    mask = masks(1, 1, 1, 2000)["boolean padding"]
    output = fused_sdpa(query, key, value, mask, is_causal=False, scale=0.125)
    expected = F.scaled_dot_product_attention(query, key, value, mask, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
    assert calls == {3: 1}


class SubclassedTensor(torch.Tensor):
    pass


CASES_LEFT_TO_PYTORCH = [
    "float16",
    "a bfloat16 cache with float32 queries",
    "gradients",
    "causal",
    "dropout",
    "a prompt's rows",
    "heads not stacked",
    "heads of 1024",
    "a head size that is not contiguous",
    "a mask of 3 dimensions",
    "a mask of another context",
    "an integer mask",
    "values of another length",
    "no sequences",
    "a tensor subclass",
    "turned off",
]


@needs_kernel
@pytest.mark.parametrize("case", CASES_LEFT_TO_PYTORCH)
def test_the_calls_it_leaves_to_pytorchs_kernel(case, monkeypatch):
    query, key, value = decode_inputs(1, 2, 4, 512, 64)
    mask, options = None, {"is_causal": False, "dropout_p": 0.0}
    assert cpu_decode_applies(query, key, value, mask, **options)
    if case == "float16":
        query, key, value = (tensor.half() for tensor in (query, key, value))
    elif case == "a bfloat16 cache with float32 queries":
        key, value = key.bfloat16(), value.bfloat16()
    elif case == "gradients":
        query.requires_grad_()
    elif case == "causal":
        options["is_causal"] = True
    elif case == "dropout":
        options["dropout_p"] = 0.1
    elif case == "a prompt's rows":
        query = query.repeat(1, 1, 9, 1)  # 36 rows
    elif case == "heads not stacked":
        query = query.reshape(1, 8, 1, 64)
    elif case == "heads of 1024":
        query, key, value = (tensor.repeat(1, 1, 1, 16) for tensor in (query, key, value))
    elif case == "a head size that is not contiguous":
        key = key.transpose(2, 3).contiguous().transpose(2, 3)
    elif case == "a mask of 3 dimensions":
        mask = torch.ones(1, 4, 512, dtype=torch.bool)
    elif case == "a mask of another context":
        mask = torch.ones(1, 1, 1, 513, dtype=torch.bool)
    elif case == "an integer mask":
        mask = torch.ones(1, 1, 1, 512, dtype=torch.int64)
    elif case == "values of another length":
        value = value[:, :, :500]
    elif case == "no sequences":
        query, key, value = query[:0], key[:0], value[:0]
    elif case == "a tensor subclass":  # its memory may not be where data_ptr() says
        key = key.as_subclass(SubclassedTensor)
    elif case == "turned off":
        monkeypatch.setenv(cpu_decode.ENV_VAR, "0")
    assert not cpu_decode_applies(query, key, value, mask, **options)


@pytest.mark.parametrize(("value", "on"), [("0", False), ("off", False), ("False", False), ("1", True), ("yes", True)])
def test_the_switch_reads_the_usual_words(monkeypatch, value, on):
    monkeypatch.setenv(cpu_decode.ENV_VAR, value)
    assert cpu_decode.turned_on() is on


def test_a_switch_value_that_is_neither_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv(cpu_decode.ENV_VAR, "fast")
    query, key, value = decode_inputs(1, 2, 2, 300, 64)
    with pytest.raises(ValueError, match="OPTIMUM_HABANA_CPU_DECODE_KERNEL='fast' is neither on nor off: set it to 0"):
        fused_sdpa(query, key, value, None, is_causal=False, scale=None)


def operators_in_graph(function, *inputs) -> list[str]:
    """The call targets of the graph torch.compile(fullgraph=True) makes of `function`, and its output."""
    targets: list[str] = []

    def backend(graph_module, example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module

    torch._dynamo.reset()
    output = torch.compile(function, fullgraph=True, backend=backend)(*inputs)
    return targets, output


@pytest.mark.parametrize("decode_kernel", ["on", "off"])
def test_compiled_code_keeps_the_decode_kernel_in_its_graph(threads, monkeypatch, decode_kernel):
    """torch.compile(fullgraph=True) keeps the decode kernel as the operator `optimum_habana.cpu_decode_attention`
    in its graph (it was once silently swapped for PyTorch's kernel), with no graph break; turned off, PyTorch's
    kernel runs whole (the context cut, which reads the thread count, never runs in a graph)."""
    if decode_kernel == "on" and cpu_decode.environment_problem() is not None:
        pytest.skip(f"no decode kernel here: {cpu_decode.environment_problem()}")
    if decode_kernel == "off":
        monkeypatch.setenv(cpu_decode.ENV_VAR, "0")
    threads(2)
    monkeypatch.setattr(split_context, "MIN_PIECE_TOKENS", 4)
    query, key, value = decode_inputs(1, 1, 4, 64, 64)
    query = query.reshape(1, 4, 1, 64)
    expected = F.scaled_dot_product_attention(query, key, value, scale=0.125, enable_gqa=True)

    def attend(query, key, value):
        return fused_sdpa(query, key, value, None, is_causal=False, scale=0.125)

    explanation = torch._dynamo.explain(attend)(query, key, value)
    assert explanation.graph_break_count == 0
    targets, output = operators_in_graph(attend, query, key, value)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
    in_graph = any(target.startswith("optimum_habana.cpu_decode_attention") for target in targets)
    assert in_graph == (decode_kernel == "on"), targets
    torch.testing.assert_close(torch.compile(attend, fullgraph=True)(query, key, value), expected)  # inductor


@needs_kernel
def test_torch_export_sees_the_decode_kernel():
    class Attend(torch.nn.Module):
        def forward(self, query, key, value):
            return fused_sdpa(query, key, value, None, is_causal=False, scale=0.125)

    query, key, value = decode_inputs(1, 2, 2, 300, 64)
    exported = torch.export.export(Attend(), (query, key, value))
    targets = [str(node.target) for node in exported.graph.nodes if node.op == "call_function"]
    assert "optimum_habana.cpu_decode_attention.default" in targets
    expected = F.scaled_dot_product_attention(query, key, value, scale=0.125)
    torch.testing.assert_close(exported.module()(query, key, value), expected, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_the_profiler_names_the_decode_kernel_at_every_decode_step(pair):
    ours, _ = pair
    inputs = left_padded_batch([20, 13])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        ours.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False, use_flash_attention=True)
    calls = [event for event in profile.events() if event.name == "optimum_habana::cpu_decode_attention"]
    assert len(calls) == 3 * ours.config.num_hidden_layers  # every layer of every decode step after the prompt


@needs_kernel
def test_traced_code_is_left_to_pytorchs_kernel():
    """torch.jit.trace cannot see a C function (its output would be traced as a constant)."""
    decisions = []

    def probe(query, key, value):
        decisions.append(cpu_decode_applies(query, key, value, None, is_causal=False, dropout_p=0.0))
        return query * 1

    inputs = decode_inputs(1, 2, 2, 300, 64)
    torch.jit.trace(probe, inputs, check_trace=False)
    assert decisions == [False] and cpu_decode_applies(*inputs, None, is_causal=False, dropout_p=0.0)


@pytest.fixture(scope="module")
def pair():
    return build_pair("llama")


@needs_kernel
@pytest.mark.parametrize("lengths", [[20], [20, 13]], ids=["one sequence", "a left-padded batch"])
def test_generate_runs_every_decode_step_on_the_kernel_and_gives_stock_tokens(pair, monkeypatch, lengths):
    ours, stock = pair
    calls = count_decode_kernel_calls(monkeypatch)
    inputs = left_padded_batch(lengths)
    settings = {"max_new_tokens": 10, "min_new_tokens": 10, **GREEDY}
    tokens = ours.generate(**inputs, use_flash_attention=True, **settings)
    assert calls == {2: 9 * 2}  # every decode step of both layers, two query heads per key/value head as rows
    assert torch.equal(tokens, stock.generate(**inputs, **settings))


@needs_kernel
def test_bfloat16_generate_runs_on_the_kernel_and_gives_stock_sdpa_tokens(monkeypatch):
    ours, stock = build_pair("llama")
    ours, stock = ours.bfloat16(), stock.bfloat16()
    stock.config._attn_implementation = "sdpa"  # PyTorch's flash kernel, in bfloat16 as ours
    calls = count_decode_kernel_calls(monkeypatch)
    inputs = left_padded_batch([20, 13])
    settings = {"max_new_tokens": 10, "min_new_tokens": 10, **GREEDY}
    tokens = ours.generate(**inputs, use_flash_attention=True, **settings)
    assert calls == {2: 9 * 2}
    assert torch.equal(tokens, stock.generate(**inputs, **settings))


@needs_kernel
def test_the_kernel_reads_the_cache_in_place_and_a_step_copies_nothing_that_grows(pair, monkeypatch):
    ours, _ = pair
    seen_storages = []
    attend = cpu_decode_sdpa

    def spy(query, key, value, *args, **kwargs):
        seen_storages.append(key.untyped_storage().data_ptr())
        return attend(query, key, value, *args, **kwargs)

    monkeypatch.setattr("optimum.habana.kernels.dispatch.cpu_decode_sdpa", spy)

    def step(context: int) -> tuple[Counter, set, set]:
        prompt = left_padded_batch([context - 5, context])  # a padding mask at every step
        mask = torch.cat([prompt["attention_mask"], torch.ones(2, 1, dtype=torch.long)], -1)
        seen_storages.clear()
        copies, storages = decode_step_copies(
            ours, prompt, {"input_ids": prompt["input_ids"][:, -1:], "attention_mask": mask}
        )
        return copies, set(seen_storages), storages

    short, short_seen, short_storages = step(40)
    long, long_seen, long_storages = step(80)
    assert short_seen == short_storages and long_seen == long_storages
    # What grows is the step's 2-D padding mask (2 sequences x 40 more tokens: its `torch.cat` here and its cast in
    # the model), once per step: no layer copies keys, values or a mask of its own.
    assert set(short) == set(long) and all(long[op] - short[op] in (0, 2 * 40) for op in long)


@needs_kernel
def test_the_kernel_is_built_once_into_the_cache_folder(fresh_build, monkeypatch):
    compiles = []
    run = subprocess.run

    def counted(command, *args, **kwargs):
        if "-shared" in command:
            compiles.append(command)
        return run(command, *args, **kwargs)

    monkeypatch.setattr(cpu_decode_library.subprocess, "run", counted)
    assert cpu_decode.decode_kernel(64) is not None
    built = sorted(path.name for path in fresh_build.iterdir())
    assert len(compiles) == 1 and len(built) == 2  # the library and its record; no temporary left
    assert built[0].startswith("cpu_decode_float32_d64_") and built[1] == built[0] + ".sha256"
    assert (fresh_build / built[0]).stat().st_mode & 0o755 == 0o755  # readable by every user of a shared folder
    cpu_decode.decode_kernel.cache_clear()  # a new process, as far as the kernel knows
    assert cpu_decode.decode_kernel(64) is not None
    assert len(compiles) == 1  # loaded, not built again
    query, key, value = decode_inputs(1, 2, 2, 700, 64)
    expected = F.scaled_dot_product_attention(query, key, value)
    torch.testing.assert_close(cpu_decode_sdpa(query, key, value, None, scale=0.125), expected, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_a_cache_folder_that_cannot_be_written_builds_in_a_temporary_folder(fresh_build, monkeypatch, tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setattr(cpu_decode_library, "cache_root", lambda: blocker)
    assert cpu_decode.decode_kernel(64) is not None
    query, key, value = decode_inputs(1, 2, 2, 700, 64)
    expected = F.scaled_dot_product_attention(query, key, value)
    torch.testing.assert_close(cpu_decode_sdpa(query, key, value, None, scale=0.125), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("problem", ["no compiler", "a failing build"])
def test_without_the_kernel_one_warning_and_pytorchs_attention(fresh_build, monkeypatch, problem):
    if problem == "no compiler":
        monkeypatch.setattr(cpu_decode_library, "compiler", lambda: None)
        expected_message = "no C compiler: install gcc, or name one in CC"
    else:
        if cpu_decode.environment_problem() is not None:
            pytest.skip(f"no decode kernel here: {cpu_decode.environment_problem()}")
        monkeypatch.setattr(cpu_decode_library, "FLAGS", (*cpu_decode_library.FLAGS, "-fno-such-option"))
        expected_message = "building it for torch.float32 heads of 64 failed"
    query, key, value = decode_inputs(1, 2, 2, 700, 64)
    query = query.reshape(1, 4, 1, 64)
    expected = F.scaled_dot_product_attention(query, key, value, enable_gqa=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = [fused_sdpa(query, key, value, None, is_causal=False, scale=None) for _ in range(3)]
    messages = [str(warning.message) for warning in caught if "CPU decode kernel" in str(warning.message)]
    assert len(messages) == 1 and expected_message in messages[0] and cpu_decode.ENV_VAR in messages[0]
    for output in outputs:
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
    assert not list(fresh_build.glob("*.so"))


def library_files(folder):
    return sorted(path for path in folder.iterdir() if path.suffix == ".so")


@needs_kernel
@pytest.mark.parametrize(
    "damage",
    [
        "cut short after a valid header", "text", "empty", "another build's library", "unreadable (another user's)",
        "its record gone",
    ],
    ids=str,
)  # fmt: skip
def test_a_damaged_library_is_built_again_never_loaded(fresh_build, monkeypatch, tmp_path, damage):
    """A damaged library in the cache folder was handed to dlopen (SIGBUS at the first decode step, or a warning in
    every process and the kernel off for good): its record no longer matches, and it is built again, silently."""
    assert cpu_decode.decode_kernel(64) is not None
    (library,) = library_files(fresh_build)
    if damage in ("unreadable (another user's)", "its record gone"):
        if damage == "its record gone":
            library.with_name(library.name + ".sha256").unlink()
        else:  # this test runs as any user, root included: the read is refused as it would be for another user
            read_bytes = Path.read_bytes
            refused = library

            def refusing(path):
                if path == refused:
                    raise PermissionError(13, "Permission denied", str(path))
                return read_bytes(path)

            monkeypatch.setattr(Path, "read_bytes", refusing)
        cpu_decode.decode_kernel.cache_clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu_decode.decode_kernel(64) is not None
        monkeypatch.undo()
        assert library.with_name(library.name + ".sha256").exists()
        return
    if damage == "cut short after a valid header":
        damaged = library.read_bytes()[:3000]
    elif damage == "text":
        damaged = b"not a library"
    elif damage == "empty":
        damaged = b""
    else:
        assert cpu_decode.decode_kernel(32) is not None
        damaged = next(path for path in library_files(fresh_build) if "_d32_" in path.name).read_bytes()
    # A new file in its place, as another process's damage looks to this one (this process has the old one mapped:
    # writing into it would fault here, not in the process the test stands for).
    replacement = tmp_path / "damaged.so"
    replacement.write_bytes(damaged)
    os.replace(replacement, library)
    cpu_decode.decode_kernel.cache_clear()  # the next process
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: it heals
        assert cpu_decode.decode_kernel(64) is not None
    query, key, value = decode_inputs(1, 2, 2, 700, 64)
    expected = F.scaled_dot_product_attention(query, key, value)
    torch.testing.assert_close(cpu_decode_sdpa(query, key, value, None, scale=0.125), expected, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_a_library_that_disagrees_with_pytorch_is_never_used(fresh_build, monkeypatch, tmp_path):
    """A library that loads but computes wrongly (here: a source whose scores are scaled 1.3x) is built again once,
    then left off with one warning; decode steps run on PyTorch's kernel."""
    planted = tmp_path / "cpu_decode.c"
    source = cpu_decode_library.SOURCE.read_text()
    planted.write_text(source.replace("const float scale = head->scale;", "const float scale = head->scale * 1.3f;"))
    assert planted.read_text() != source
    monkeypatch.setattr(cpu_decode_library, "SOURCE", planted)
    query, key, value = decode_inputs(1, 2, 2, 700, 64)
    expected = F.scaled_dot_product_attention(query, key, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = [fused_sdpa(query, key, value, None, is_causal=False, scale=None) for _ in range(2)]
    messages = [str(warning.message) for warning in caught if "CPU decode kernel" in str(warning.message)]
    assert len(messages) == 1 and "gives other results than PyTorch's attention" in messages[0]
    for output in outputs:
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_a_read_only_cache_folder_leaves_no_temporary_folder(fresh_build, monkeypatch, tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setattr(cpu_decode_library, "cache_root", lambda: blocker)
    temporary = Path(tempfile.gettempdir())
    before = set(temporary.glob("optimum-habana-kernels-*"))
    assert cpu_decode.decode_kernel(64) is not None
    assert set(temporary.glob("optimum-habana-kernels-*")) == before


def test_the_cache_key_names_the_cpu_on_arm_too(monkeypatch, tmp_path):
    cpuinfo = "processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n"
    identities = []
    for features in ("fp asimd sve", "fp asimd"):
        info = tmp_path / f"cpuinfo-{len(features)}"
        info.write_text(cpuinfo.replace("fp asimd sve", features))
        monkeypatch.setattr(
            cpu_decode_library, "Path", lambda path, info=info: info if path == "/proc/cpuinfo" else Path(path)
        )
        identities.append(cpu_decode_library.cpu_identity())
    assert identities[0] != identities[1] and "0xd40" in identities[0]


@needs_kernel
@pytest.mark.parametrize("kv_heads", [1, 2, 8], ids=lambda heads: f"{heads} key/value heads")
@pytest.mark.parametrize("variant", ["sinks", "latent values", "both"])
def test_sinks_and_latent_values_run_on_the_kernel_as_they_are(variant, kv_heads, monkeypatch):
    """A decode step with sinks (gpt-oss) or values of another size than the queries (DeepSeek's latent attention)
    runs on the decode kernel: the sinks join each row's softmax and the weighted sum runs over the values' own
    width, with no sink column added to the keys and no value padded (each a copy as long as the context). Against
    the attention written out, padded rows masked, on 2 threads."""
    calls = count_decode_kernel_calls(monkeypatch)
    generator = torch.Generator().manual_seed(1)
    value_dim = 48 if variant != "sinks" else 64
    query = torch.randn(2, 8, 1, 64, generator=generator)
    key = torch.randn(2, kv_heads, 600, 64, generator=generator)
    value = torch.randn(2, kv_heads, 600, value_dim, generator=generator)
    sinks = torch.randn(8, generator=generator) if variant != "latent values" else None
    mask = torch.ones(2, 1, 1, 600, dtype=torch.bool)
    mask[0, ..., :150] = False
    with no_copy_as_long_as(600, monkeypatch) as copies:
        output = fused_sdpa(query, key, value, mask, is_causal=False, scale=0.125, sinks=sinks)
    assert not copies and sum(calls.values()) == 1
    groups = 8 // kv_heads
    expected = cpu_decode._reference_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), mask, 0.125, sinks
    )
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


@contextmanager
def no_copy_as_long_as(length: int, monkeypatch):
    """The padding and concatenation calls made with an operand as long as `length` tokens (a copy of the cache)."""
    copies = []
    for module, name in ((F, "pad"), (torch, "cat")):
        original = getattr(module, name)

        def spied(*args, original=original, name=name, **kwargs):
            tensors = args[0] if isinstance(args[0], list | tuple) else [args[0]]
            if any(isinstance(tensor, torch.Tensor) and length in tensor.shape for tensor in tensors):
                copies.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, spied)
    yield copies


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(finished.stdout)


@needs_kernel
def test_a_build_killed_midway_is_removed_by_the_next_build(fresh_build):
    """A build writes its library under a name with its host and pid; one that `kill -9` stopped is removed by the
    next build, one still running (this process's) is left alone."""
    fresh_build.mkdir(parents=True)
    running = staging_path(fresh_build, cpu_decode_library.BUILD_PREFIX)
    killed = running.with_name(running.name.replace(f"~{os.getpid()}~", f"~{dead_pid()}~"))
    killed.write_bytes(b"half a library")
    running.write_bytes(b"being written")
    assert cpu_decode.decode_kernel(64) is not None
    assert not killed.exists() and running.exists()
