"""`fused_sdpa` decides its path once (`kernel_path`): the transforms, then exactly one kernel, whose result is the
attention written out. Each case names the path it must take, so a changed decision fails here by name."""

import pytest
import torch

from optimum.habana.kernels import cpu_decode, dispatch, split_context
from optimum.habana.kernels.dispatch import KernelPath, fused_sdpa


KERNELS = ("cpu_decode_sdpa", "split_context_sdpa", "_torch_fused_sdpa")


def reference(query, key, value, mask, *, is_causal, scale, sinks=None):
    """The attention written out in float64: key/value heads repeated for their query groups, sinks as a last
    column of the softmax that is then dropped."""
    query, key, value = (tensor.double() for tensor in (query, key, value))
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * scale
    if is_causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    if sinks is not None:
        logits = sinks.double().reshape(sinks.shape[0] if sinks.dim() > 1 else 1, query.shape[1], -1, 1)
        scores = torch.cat([scores, logits.expand(*scores.shape[:3], 1)], dim=-1)
    weights = torch.softmax(scores, dim=-1)[..., : key.shape[2]]
    return weights @ value


def call(batch=2, heads=4, kv_heads=2, q_len=1, kv_len=40, head_dim=16, value_dim=16, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, q_len, head_dim, generator=generator).to(dtype)
    key = torch.randn(batch, kv_heads, kv_len, head_dim, generator=generator).to(dtype)
    value = torch.randn(batch, kv_heads, kv_len, value_dim, generator=generator).to(dtype)
    mask = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool)
    mask[0, ..., :3] = False  # a left-padded row
    return query, key, value, mask


@pytest.fixture
def kernels_run(monkeypatch) -> list[str]:
    """The kernels `fused_sdpa` calls itself, by name ("pytorch": PyTorch's own choice of backend)."""
    ran = []

    def counted(name, kernel):
        def run(*args, **kwargs):
            inner = len(ran)
            output = kernel(*args, **kwargs)
            del ran[inner:]  # what a kernel runs inside is its own business
            ran.append(name)
            return output

        return run

    for name in KERNELS:
        monkeypatch.setattr(dispatch, name, counted(name, getattr(dispatch, name)))
    attend = counted("pytorch", torch.nn.functional.scaled_dot_product_attention)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", attend)
    return ran


SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])


CASES = {
    # name: (call's shapes, masked, causal, sinks, the path)
    "grouped decode, sinks": ({}, True, False, SINKS, KernelPath(False, True, False, "cpu_decode")),
    "grouped decode, per-row sinks": (
        {}, True, False, torch.randn(2, 4, 1, 1), KernelPath(False, True, False, "cpu_decode"),
    ),
    "grouped decode, sinks, float16": (
        {"dtype": torch.float16}, True, False, SINKS, KernelPath(True, True, True, "pytorch_fused"),
    ),
    "latent decode": ({"kv_heads": 4, "head_dim": 24}, True, False, None, KernelPath(False, False, False, "cpu_decode")),
    "latent decode, float16": (
        {"kv_heads": 4, "head_dim": 24, "dtype": torch.float16}, True, False, None,
        KernelPath(False, False, False, "pytorch"),
    ),
    "latent prompt": (
        {"kv_heads": 4, "head_dim": 24, "q_len": 40}, False, True, None, KernelPath(False, False, True, "pytorch_fused"),
    ),
    "prompt with sinks": ({"q_len": 40}, False, True, SINKS, KernelPath(True, False, True, "pytorch_fused")),
    "grouped prompt": ({"q_len": 40}, False, True, None, KernelPath(False, False, False, "pytorch_fused")),
}  # fmt: skip


@pytest.mark.parametrize(("shapes", "masked", "causal", "sinks", "expected"), CASES.values(), ids=list(CASES))
def test_each_call_takes_its_path_and_runs_one_kernel(kernels_run, shapes, masked, causal, sinks, expected):
    if expected.kernel == "cpu_decode" and cpu_decode.environment_problem() is not None:
        pytest.skip(f"no decode kernel here: {cpu_decode.environment_problem()}")
    query, key, value, mask = call(**shapes)
    mask = mask if masked else None
    path = dispatch.kernel_path(query, key, value, mask, is_causal=causal, dropout_p=0.0, sinks=sinks)
    assert path == expected
    output = fused_sdpa(query, key, value, mask, is_causal=causal, scale=0.3, sinks=sinks)
    kernel_names = {"cpu_decode": "cpu_decode_sdpa", "pytorch_fused": "_torch_fused_sdpa", "pytorch": "pytorch"}
    assert kernels_run == [kernel_names[expected.kernel]]
    assert output.shape == (*query.shape[:3], value.shape[-1])
    expected_output = reference(query, key, value, mask, is_causal=causal, scale=0.3, sinks=sinks)
    tolerance = 1e-5 if query.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(output.double(), expected_output, rtol=tolerance, atol=tolerance)


def test_a_cut_context_takes_the_sinks_as_one_more_piece(kernels_run, monkeypatch):
    """One sequence's decode step with the decode kernel off and idle threads: its context in pieces, the sinks
    combined with them, no sink key."""
    monkeypatch.setenv(cpu_decode.ENV_VAR, "0")
    monkeypatch.setattr(split_context, "MIN_PIECE_TOKENS", 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    query, key, value, mask = call(batch=1)
    mask[..., :5] = False
    path = dispatch.kernel_path(query, key, value, mask, is_causal=False, dropout_p=0.0, sinks=SINKS)
    assert path.kernel == "split_context" and path.splits > 1 and not path.sink_key and path.query_rows
    output = fused_sdpa(query, key, value, mask, is_causal=False, scale=0.3, sinks=SINKS)
    assert kernels_run == ["split_context_sdpa"]
    expected = reference(query, key, value, mask, is_causal=False, scale=0.3, sinks=SINKS)
    torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-5)


def test_fused_sdpa_never_calls_itself(monkeypatch):
    """Every transform happens in the one call: the local and variable-length kernels call `fused_sdpa` for their
    pieces, `fused_sdpa` itself never."""
    calls = []
    attend = dispatch.fused_sdpa

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return attend(*args, **kwargs)

    monkeypatch.setattr(dispatch, "fused_sdpa", counted)
    for shapes, masked, causal, sinks, _ in CASES.values():
        query, key, value, mask = call(**shapes)
        calls.clear()
        counted(query, key, value, mask if masked else None, is_causal=causal, scale=0.3, sinks=sinks)
        assert len(calls) == 1


@pytest.mark.parametrize(
    "trained",
    [None, "sinks", "value"],
    ids=["inference: FusedSDPA's sinks", "training: a sink key", "training the value alone: a sink key"],
)
def test_on_gaudi_the_sinks_go_to_fusedsdpa_or_one_more_key_with_equal_head_sizes(trained, monkeypatch):
    """FusedSDPA takes one head size (the double checks it): a sink key widens the query and key, so the value is
    padded to them; in inference a Gaudi software with the sink argument takes the sinks itself. The kernel trains
    when any input needs a gradient (LoRA on v_proj alone): its backward knows no sinks, so those get a sink key."""
    from optimum.habana import hpu
    from tests.core import fake_habana

    state = fake_habana.install(monkeypatch, "1.18-sinks")
    hpu.hpu_kernel.cache_clear()
    fake_habana.treat_tensors_as_hpu(monkeypatch)
    try:
        query, key, value, mask = call(q_len=40)
        training = trained is not None
        sinks = SINKS.clone().requires_grad_(trained == "sinks")
        value.requires_grad_(trained == "value")
        path = dispatch.kernel_path(query, key, value, None, is_causal=True, dropout_p=0.0, sinks=sinks)
        assert path == KernelPath(training, False, training, "FusedSDPA")
        with torch.set_grad_enabled(training):
            output = fused_sdpa(query, key, value, None, is_causal=True, scale=0.3, sinks=sinks, recompute=True)
        (kernel_call,) = state.calls
        assert kernel_call.query.shape[-1] == kernel_call.value.shape[-1] == 16 + (8 if training else 0)
        expected = reference(query, key, value, None, is_causal=True, scale=0.3, sinks=SINKS)
        torch.testing.assert_close(output.detach().double(), expected, rtol=1e-5, atol=1e-5)
    finally:
        hpu.hpu_kernel.cache_clear()


def test_grouped_heads_are_repeated_where_cudas_float32_kernel_takes_no_groups(monkeypatch):
    """On CUDA in float32 only PyTorch's memory-efficient kernel is fused, and it takes no grouped heads: the call's
    key and value heads are repeated for it. Here the rule is forced on the CPU's tensors, whose kernel takes both."""
    assert not dispatch.heads_expanded_for_cuda(torch.empty(1, 8, 4, 16), torch.empty(1, 2, 4, 16))  # not CUDA
    query, key, value = torch.randn(2, 8, 6, 16), torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    expected = dispatch._torch_fused_sdpa(query, key, value, None, is_causal=True, scale=None, dropout_p=0.0)
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recorded(*arguments, **options):
        seen.append((arguments, options))
        return sdpa(*arguments, **options)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    monkeypatch.setattr(dispatch, "heads_expanded_for_cuda", lambda query, key: query.shape[1] != key.shape[1])
    found = dispatch._torch_fused_sdpa(query, key, value, None, is_causal=True, scale=None, dropout_p=0.0)
    ((arguments, options),) = seen
    assert arguments[1].shape[1] == arguments[2].shape[1] == 8 and not options["enable_gqa"]
    torch.testing.assert_close(found, expected, rtol=0, atol=1e-6)
