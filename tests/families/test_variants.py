"""The attention variants of the 2026 families, each proven once at the kernel and once through a representative
family: attention sinks, latent attention, an indexer's selected keys, per-layer geometry, hybrids, chunked and
alternating windows; on the fused path of CPU/CUDA, through the HPU double, compiled, and in continuous batching."""

import pytest
import torch
from torch.nn import functional as F

from optimum.habana.kernels.dispatch import fused_sdpa
from optimum.habana.transformers import attention
from tests.families.support import LENGTHS, assert_same_steps, family_pair, greedy, repeated_layers
from tests.helpers import in_make_test, left_padded_batch


def eager_with_sinks(query, key, value, mask, scale, sinks):
    """gpt-oss's eager attention: the sink logit as a last score column, softmax, the column dropped."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    logits = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[2], 1)
    probabilities = torch.cat([scores, logits], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probabilities, value)


def random_attention(q_len: int, kv_len: int, value_dim: int = 16, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(2, 4, q_len, 16, generator=generator, requires_grad=True)
    key = torch.randn(2, 2, kv_len, 16, generator=generator, requires_grad=True)
    value = torch.randn(2, 2, kv_len, value_dim, generator=generator, requires_grad=True)
    sinks = torch.randn(4, generator=generator, requires_grad=True)
    return query, key, value, sinks


@pytest.mark.parametrize(
    ("q_len", "kv_len", "masked"),
    [(9, 9, False), (9, 9, True), (1, 12, False), (3, 12, True)],
    ids=["causal prompt", "prompt with a mask", "decode step", "chunk after a cache"],
)
def test_sinks_on_the_fused_kernel_match_eager_with_gradients(q_len, kv_len, masked):
    query, key, value, sinks = random_attention(q_len, kv_len)
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None].expand(2, 1, -1, -1)
    if masked:
        allowed = allowed.clone()
        allowed[0, :, :, :2] = False  # a left-padded row
        allowed[0, :, : min(2, q_len)] = True  # no row fully masked (its output is a convention)
    reference = eager_with_sinks(query, key, value, allowed, 0.25, sinks)
    mask = allowed if masked or q_len != kv_len else None
    output = fused_sdpa(query, key, value, mask, is_causal=mask is None and q_len > 1, scale=0.25, sinks=sinks)
    torch.testing.assert_close(output, reference, rtol=1e-5, atol=1e-6)
    expected = torch.autograd.grad(reference.square().sum(), (query, key, value, sinks))
    found = torch.autograd.grad(output.square().sum(), (query, key, value, sinks))
    for name, a, b in zip(("query", "key", "value", "sinks"), found, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_latent_attention_value_head_is_padded_for_the_call_only():
    query, key, value, _ = random_attention(7, 7, value_dim=8)
    output = fused_sdpa(query, key, value, None, is_causal=True, scale=None)
    assert output.shape == (2, 4, 7, 8)
    groups = 2
    reference = F.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), is_causal=True
    )
    torch.testing.assert_close(output, reference, rtol=1e-5, atol=1e-6)


def test_the_default_path_computes_sinks_as_the_family_does():
    query, key, value, sinks = random_attention(6, 6)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    output, weights = attention.matmul_softmax_attention(query, key, value, None, 0.25, sinks=sinks)
    torch.testing.assert_close(output.transpose(1, 2), eager_with_sinks(query, key, value, allowed, 0.25, sinks))
    assert (weights.sum(-1) < 1).all()  # the sink took its share; the weights returned leave it out


def test_an_indexer_selection_is_never_silently_dense():
    """DeepSeek V3.2's indexer keeps `index_topk` keys per query: fused and default paths keep exactly those."""
    ours, stock = family_pair("deepseek_v32")
    inputs = left_padded_batch(LENGTHS)
    dense, _ = family_pair("deepseek_v32", index_topk=64)  # as many keys as the cache: the selection is void
    with torch.no_grad():
        expected = stock(**inputs).logits
        unselected = dense(**inputs).logits
        sparse = ours(**inputs, use_flash_attention=True).logits
    real = inputs["attention_mask"].bool()
    assert (sparse[real] - expected[real]).abs().max() <= 1e-4
    assert (unselected[real] - expected[real]).abs().max() > 1e-2  # the selection matters at these sizes


def flash_tokens_through_the_hpu_double(monkeypatch, model, version: str = "1.18", lengths=tuple(LENGTHS)):
    """The model's greedy tokens with the flag, every kernel call made to the HPU double of `version`; and the
    double's record of those calls."""
    from optimum.habana import hpu
    from tests.core import fake_habana

    state = fake_habana.install(monkeypatch, version)
    hpu.hpu_kernel.cache_clear()
    fake_habana.treat_tensors_as_hpu(monkeypatch)
    try:
        tokens = greedy(model, left_padded_batch(list(lengths)), use_flash_attention=True)
    finally:
        hpu.hpu_kernel.cache_clear()
    assert state.calls
    return tokens, state


@pytest.mark.parametrize("version", ["1.18-sinks", "1.18"])
def test_sinks_through_the_hpu_double(version, monkeypatch):
    """Gaudi software whose FusedSDPA takes sinks gets them (inference, recompute variant); older software gets the
    sink key, which any kernel computes. Either way, the default path's tokens."""
    ours, _ = family_pair("gpt_oss")
    expected = greedy(ours, left_padded_batch(LENGTHS))
    tokens, state = flash_tokens_through_the_hpu_double(monkeypatch, ours, version)
    assert_same_steps(tokens, expected)
    head_dim = ours.config.head_dim
    for call in state.calls:
        if version == "1.18-sinks":
            assert call.arguments["sink"] is not None and call.arguments["recompute_mode"] is True
            assert call.query.shape[-1] == head_dim
        else:
            assert "sink" not in call.arguments and call.query.shape[-1] == head_dim + 8  # the sink column


def test_latent_attention_through_the_hpu_double(monkeypatch):
    """Prompts longer than absorption pays for (32 rows at these sizes) run on FusedSDPA, the value padded to the
    query's head size for the call; decode steps attend over the compressed cache (`kernels/latent.py`)."""
    ours, _ = family_pair("deepseek_v3")
    lengths = [40, 33, 36]
    expected = greedy(ours, left_padded_batch(lengths))
    tokens, state = flash_tokens_through_the_hpu_double(monkeypatch, ours, lengths=lengths)
    assert_same_steps(tokens, expected)
    assert len(state.calls) == ours.config.num_hidden_layers  # the prompt's calls; no decode step's
    for call in state.calls:
        assert call.query.shape[2] == 40 and call.value.shape[-1] == call.query.shape[-1] == ours.config.qk_head_dim


# One family per variant, made from transformers' class.
REPRESENTATIVES = {
    "gpt_oss": "attention sinks, alternating sliding windows",
    "deepseek_v3": "latent attention",
    "deepseek_v32": "latent attention, with an indexer's selected keys",
    "qwen3_next": "hybrid: linear attention beside full attention",
    "gemma4_text": "per-layer head sizes",
    "llama4_text": "chunked local attention",
}


# Sinks and latent attention in `make test`; the other variants' traces (5-6 s each) under `families`
@pytest.mark.parametrize("model_type", in_make_test(REPRESENTATIVES, kept={"gpt_oss", "deepseek_v3"}))
def test_traces_like_stock_and_reads_the_host_no_more(model_type):
    """No more graph breaks than stock's class with its own attention, and no host read inside the layers: the same
    reads with one and two layers of each kind."""
    from optimum.habana.utils.graph_capture import HostReads, graph_report

    ours, stock = family_pair(model_type)
    ours.generation_config.use_flash_attention = True
    stock.set_attn_implementation("sdpa" if stock._supports_sdpa else "eager")
    inputs = left_padded_batch(LENGTHS)
    with torch.no_grad():
        stock_breaks = graph_report(stock, **inputs).graph_breaks
        our_breaks = graph_report(ours, **inputs).graph_breaks
        assert our_breaks <= stock_breaks
        reads = []
        for times in (1, 2):
            deeper, _ = family_pair(model_type, **repeated_layers(ours.config, times))
            with HostReads() as counted:
                deeper(**inputs, use_flash_attention=True)
            reads.append(counted.total)
        assert reads[0] == reads[1], f"{reads}: a host read inside a layer"


@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v3", "gemma4_text", "llama4_text"])
def test_compiles_fullgraph_with_eager_outputs(model_type):
    ours, _ = family_pair(model_type)
    inputs = left_padded_batch(LENGTHS)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True, backend="eager", dynamic=False)
    with torch.no_grad():
        logits = compiled(**inputs, use_flash_attention=True, use_cache=False).logits
        expected = ours(**inputs, use_flash_attention=True, use_cache=False).logits
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", REPRESENTATIVES)
def test_continuous_batching_serves_each_request_or_refuses_the_family_in_one_line(model_type, monkeypatch):
    """Where transformers' engine serves the family, each request gets its generate() tokens, every call fused; where
    it does not (stock fails there too), one line before any request."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    from tests.core.test_continuous_batching import by_request, greedy_config, one_by_one, prompts, small_engine
    from tests.helpers import count_attention_paths

    ours, stock = family_pair(model_type)
    requests = prompts()
    engine = {"inputs": requests, "continuous_batching_config": small_engine()}
    try:
        stock_outputs = stock.generate_batch(generation_config=greedy_config(), **engine)
        stock_served = all(output.status == RequestStatus.FINISHED for output in stock_outputs.values())
    except Exception:
        stock_served = False
    if not stock_served:
        with pytest.raises(ValueError, match="cannot run in transformers' continuous batching: its"):
            ours.generate_batch(generation_config=greedy_config(use_flash_attention=True), **engine)
        return
    expected = one_by_one(ours, requests)
    with count_attention_paths(monkeypatch, profile=False) as counts:
        outputs = ours.generate_batch(generation_config=greedy_config(use_flash_attention=True), **engine)
    assert by_request(outputs) == expected
    assert counts["fused"] > 0 and counts["default"] == 0


def dense_local_reference(query, key, value, allowed):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(-1, -2)) * query.shape[-1] ** -0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ value


@pytest.mark.parametrize("extent", [1, 3, 4, 7, 13, 20])
def test_windows_and_chunks_in_pieces_match_their_dense_masks(extent):
    """`kernels/local_attention.py`: no `[q, kv]` mask, the dense mask's output and gradients, for windows and
    chunks that divide the length, do not, or exceed it."""
    from optimum.habana.kernels.local_attention import chunked_causal_sdpa, windowed_causal_sdpa

    query, key, value, _ = random_attention(13, 13, value_dim=8)
    positions = torch.arange(13)
    causal = positions[None] <= positions[:, None]
    masks = {
        windowed_causal_sdpa: causal & (positions[None] > positions[:, None] - extent),
        chunked_causal_sdpa: causal & (positions[None] // extent == positions[:, None] // extent),
    }
    for function, allowed in masks.items():
        output = function(query, key, value, extent, scale=None)
        reference = dense_local_reference(query, key, value, allowed)
        torch.testing.assert_close(output, reference, rtol=1e-5, atol=1e-6)
        found = torch.autograd.grad(output.sum(), (query, key, value))
        expected = torch.autograd.grad(reference.sum(), (query, key, value))
        for a, b in zip(found, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("padding", ["left", "right", "middle"])
def test_a_local_layers_padded_prompt_keeps_transformers_window(padding, monkeypatch):
    """gpt-oss (windows of 8 alternating with full layers, and sinks) on 12-token prompts: left and right padding run
    in windows, padding in the middle (whose window counts the padding, as transformers' does) through the mask."""
    ours, stock = family_pair("gpt_oss")
    inputs = left_padded_batch(LENGTHS)
    if padding == "right":
        inputs = {name: tensor.flip(-1) for name, tensor in inputs.items()}
    elif padding == "middle":
        inputs["attention_mask"][0, 3:5] = 0
    with torch.no_grad():
        expected = stock(**inputs).logits
        logits = ours(**inputs, use_flash_attention=True).logits
    real = inputs["attention_mask"].bool()
    assert (logits[real] - expected[real]).abs().max() <= 1e-4


@pytest.mark.parametrize("model_type", in_make_test(["phimoe", "doge"], {"phimoe"}))
def test_a_window_the_mask_builder_takes_from_the_config_is_kept_by_the_flag(model_type):
    """PhiMoE (and Doge) window their layers through the mask alone: `create_sliding_window_causal_mask`
    when `config.sliding_window` is set, no window handed to the attention, no layer kinds. The flag's planned prompt
    replaced that mask and attended causally over the whole prompt (logits 0.1-0.5 off at every real position)."""
    ours, stock = family_pair(model_type, sliding_window=4)
    assert ours.config.sliding_window == 4 and getattr(ours.config, "layer_types", None) is None
    inputs = left_padded_batch(LENGTHS)
    expected = greedy(stock, inputs)
    assert_same_steps(greedy(ours, inputs, use_flash_attention=True), expected)
    right = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"].flip(-1)}
    with torch.no_grad():
        found = ours(**right, use_flash_attention=True).logits
        reference = stock(**right).logits
    real = right["attention_mask"].bool()
    torch.testing.assert_close(found[real], reference[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", in_make_test(["mistral", "gemma3_text", "gpt_oss", "cohere2"], {"mistral"}))
def test_a_windowed_row_padded_on_both_sides_continues_as_stocks(model_type):
    """Padding before and after a row's tokens (transformers' model tests pad a lower-triangular batch on the left):
    a windowed layer runs it with transformers' mask, whose padding queries see the real keys before them. All were
    zeroed, the last one too, from which generate() continues: other tokens than stock's."""
    ours, stock = family_pair(model_type)
    input_ids = torch.randint(3, 200, (2, 14), generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = attention_mask[0, 11:] = 0  # 2 padding, 9 real tokens, 3 padding
    inputs = {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask}
    assert_same_steps(greedy(ours, inputs, use_flash_attention=True), greedy(stock, inputs))
