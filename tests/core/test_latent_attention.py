"""Latent attention's decode steps over the compressed cache (`kernels/latent.py`, `transformers/latent_attention.py`):
the expanded attention's outputs, no expansion or copy as long as the context, and the family's own expansion
wherever absorbing would not compute what its code computes."""

import copy
import math
import pickle
from collections import Counter

import pytest
import torch
from transformers import DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from optimum.habana.kernels.latent import absorbed_latent_sdpa, absorbs
from optimum.habana.transformers import attention
from optimum.habana.transformers.attention import matmul_softmax_attention
from optimum.habana.transformers.growing_cache import GrowingCache
from optimum.habana.transformers.latent_attention import (
    KeepCompressed,
    expanded,
    hands_expanded_latent,
    receives_compressed_latent,
)
from tests.families.support import assert_same_steps, family_pair, greedy
from tests.helpers import CopiedElements, left_padded_batch, record_absorbed_rows


def latent_inputs(q_len: int, kv_len: int, dtype=torch.float32):
    """A DeepSeek-V3 attention module of 4 heads (query/key 24 = 16 + 8 rotary, values 16, latent 32) and a query,
    latent and rotary key of its sizes."""
    _, stock = family_pair("deepseek_v3")
    module = stock.model.layers[0].self_attn.to(dtype)
    generator = torch.Generator().manual_seed(2)
    heads, latent_size, rope = module.num_heads, module.kv_lora_rank, module.qk_rope_head_dim
    query = torch.randn(2, heads, q_len, module.qk_head_dim, generator=generator).to(dtype)
    latent = torch.randn(2, 1, kv_len, latent_size, generator=generator).to(dtype)
    rotary_key = torch.randn(2, 1, kv_len, rope, generator=generator).to(dtype)
    return module, query, latent, rotary_key


@pytest.mark.parametrize("mask_kind", ["none", "boolean", "additive", "a row masked whole"])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("sinks", [None, "per head"])
def test_absorbed_attention_is_the_expanded_attention(mask_kind, q_len, sinks):
    """Against the default path over the family's own expansion (`expand_kv`), fp32."""
    module, query, latent, rotary_key = latent_inputs(q_len, 40)
    key, value = type(module).expand_kv(module, latent, rotary_key)
    allowed = torch.ones(2, 1, q_len, 40, dtype=torch.bool)
    allowed[0, ..., :15] = False  # left padding
    if mask_kind == "a row masked whole":
        allowed[1] = False
    mask = {"none": None, "additive": torch.zeros(2, 1, q_len, 40).masked_fill(~allowed, torch.finfo().min)}.get(
        mask_kind, allowed
    )
    sink_logits = torch.randn(module.num_heads) if sinks else None
    scale = module.scaling
    found = absorbed_latent_sdpa(
        query, latent, rotary_key, module.kv_b_proj.weight, mask, scale=scale, sinks=sink_logits
    )
    expected, _ = matmul_softmax_attention(query, key, value, mask, scale, is_causal=False, sinks=sink_logits)
    assert found.shape == (2, module.num_heads, q_len, module.v_head_dim)
    torch.testing.assert_close(found, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_bfloat16_absorbed_attention_is_the_expanded_attention_within_its_rounding():
    module, query, latent, rotary_key = latent_inputs(1, 300, torch.bfloat16)
    key, value = type(module).expand_kv(module, latent, rotary_key)
    found = absorbed_latent_sdpa(query, latent, rotary_key, module.kv_b_proj.weight, None, scale=module.scaling)
    expected, _ = matmul_softmax_attention(query.float(), key.float(), value.float(), None, module.scaling)
    torch.testing.assert_close(found.float(), expected.transpose(1, 2), rtol=2e-2, atol=2e-2)


def test_a_half_precision_step_on_cpu_copies_neither_the_up_projection_nor_the_cache():
    """PyTorch's CPU products in half precision (oneDNN) copy an operand whose matrices do not lie back to back or
    lie transposed: each head's key rows of the up-projection (between its value rows), and a batch's latents and
    rotary keys in a cache whose storage is longer than its tokens, were copied whole at every decode step. The
    geometry is about the smallest at which those copies happen."""
    heads, nope, rope, latent_size, value_size, tokens, capacity = 8, 32, 16, 64, 32, 40, 48
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(2, heads, 1, nope + rope, generator=generator)
    latent = torch.randn(2, 1, capacity, latent_size, generator=generator)[:, :, :tokens]
    rotary_key = torch.randn(2, 1, capacity, rope, generator=generator)[:, :, :tokens]
    up_projection = torch.randn(heads * (nope + value_size), latent_size, generator=generator) / latent_size**0.5
    expected = absorbed_latent_sdpa(query, latent, rotary_key, up_projection, None, scale=0.1)
    halves = [tensor.bfloat16() for tensor in (query, up_projection)]
    cache = [torch.empty(2, 1, capacity, tensor.shape[-1], dtype=torch.bfloat16) for tensor in (latent, rotary_key)]
    for storage, tensor in zip(cache, (latent, rotary_key), strict=True):
        storage[:, :, :tokens] = tensor
    latent_half, rotary_half = (storage[:, :, :tokens] for storage in cache)
    with torch.profiler.profile(record_shapes=True) as profile:
        found = absorbed_latent_sdpa(halves[0], latent_half, rotary_half, halves[1], None, scale=0.1)
    copied = [event.input_shapes[0] for event in profile.events() if event.name == "aten::copy_"]
    # The smallest of them, the rotary keys, against the scores' own casts (2 x 8 heads x 40 keys)
    assert all(math.prod(shape) < rotary_half.numel() for shape in copied), copied
    torch.testing.assert_close(found.float(), expected, rtol=2e-2, atol=2e-2)


def test_a_half_precision_step_exports_with_any_batch_size():
    """Compiled or exported, the step keeps one batched product (one product per sequence would fix the batch size)."""

    class Step(torch.nn.Module):
        def forward(self, query, latent, rotary_key, up_projection):
            return absorbed_latent_sdpa(query, latent, rotary_key, up_projection, None, scale=0.2)

    heads, nope, rope, latent_size, value_size = 4, 16, 8, 32, 12
    inputs = [
        torch.randn(3, heads, 1, nope + rope),
        torch.randn(3, 1, 20, latent_size),
        torch.randn(3, 1, 20, rope),
        torch.randn(heads * (nope + value_size), latent_size),
    ]
    batch = torch.export.Dim("batch", min=2, max=64)
    exported = torch.export.export(
        Step(),
        tuple(tensor.bfloat16() for tensor in inputs),
        dynamic_shapes=({0: batch}, {0: batch}, {0: batch}, None),
    )
    five = [torch.cat([tensor] * 2)[:5] if tensor.dim() == 4 else tensor for tensor in inputs]
    halves = [tensor.bfloat16() for tensor in five]
    torch.testing.assert_close(exported.module()(*halves), Step()(*halves), rtol=1e-2, atol=1e-2)


def test_absorption_is_chosen_where_it_does_less_work():
    # DeepSeek-V3's geometry: latent 512, rotary 64, query/key heads of 128 + 64, values of 128
    assert absorbs(1, 512, 64, 128, 128) and absorbs(170, 512, 64, 128, 128)
    assert not absorbs(171, 512, 64, 128, 128) and not absorbs(2048, 512, 64, 128, 128)


def decode_step(model, context: int, monkeypatch, **flags) -> tuple[Counter, list[int], torch.Tensor]:
    """A prompt of `context` tokens, then one decode step: what the step copied, the token counts of the expansions
    the Gaudi attention ran (a stock model's, run by its own code, are not seen), and its logits."""
    inputs = left_padded_batch([context - 4, context], seed=5)
    cache = GrowingCache(model.config)  # in place: stock's DynamicCache copies itself at every step
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], -1)
    step = {"input_ids": inputs["input_ids"][:, -1:], "attention_mask": mask}
    rows = []
    with torch.no_grad():
        model(**inputs, past_key_values=cache, use_cache=True, **flags)
        # A spy on the expansion the attention calls (a hook on kv_b_proj would itself send the step there).
        monkeypatch.setattr(
            attention,
            "expanded",
            lambda module, latent, *a: rows.append(latent.shape[2]) or expanded(module, latent, *a),
        )
        with CopiedElements() as counter:
            logits = model(**step, past_key_values=cache, use_cache=True, **flags).logits
        monkeypatch.undo()
    return counter.counts, rows, logits


def test_a_decode_step_expands_and_copies_nothing_as_long_as_the_context(monkeypatch):
    """With the flag, a DeepSeek-V3 decode step copies the same at two contexts and expands nothing; without it (the
    default path is stock's), each layer expands its whole cache, as the family's own code does. Same logits."""
    ours, stock = family_pair("deepseek_v3")
    layers = ours.config.num_hidden_layers
    (short, short_rows, _), (long, long_rows, flash_logits) = (
        decode_step(ours, context, monkeypatch, use_flash_attention=True) for context in (40, 80)
    )
    # The 2-D padding mask (its cast in the model) grows by one token per sequence and step; nothing else.
    assert set(short) == set(long) and all(long[op] - short[op] in (0, 2 * 40) for op in long)
    assert short_rows == long_rows == []
    _, default_rows, default_logits = decode_step(ours, 80, monkeypatch, use_flash_attention=False)
    assert default_rows == [81] * layers
    _, _, stock_logits = decode_step(stock, 80, monkeypatch)
    torch.testing.assert_close(flash_logits, stock_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(default_logits, stock_logits, rtol=0, atol=0)


def test_a_layer_that_computes_other_than_its_weight_is_expanded_by_the_family(monkeypatch):
    """A hook on `kv_b_proj` (as an adapter, quantization or offloading puts there) changes what the expansion
    computes: the step then runs the family's own expansion, and the flag's logits stay the default path's."""
    ours, _ = family_pair("deepseek_v3")
    for module in ours.modules():
        if receives_compressed_latent(module):
            module.kv_b_proj.register_forward_hook(lambda _, args, output: output * 1.5)
    absorbed = record_absorbed_rows(monkeypatch)
    inputs = left_padded_batch([12, 5, 9])
    assert_same_steps(greedy(ours, inputs, use_flash_attention=True), greedy(ours, inputs))
    assert absorbed == []


def test_a_lora_adapter_on_kv_b_proj_reaches_every_step():
    peft = pytest.importorskip("peft")
    ours, _ = family_pair("deepseek_v3")
    adapted = peft.get_peft_model(
        ours, peft.LoraConfig(target_modules=["kv_b_proj"], r=4, init_lora_weights=False)
    ).eval()
    inputs = left_padded_batch([12, 5, 9])
    assert_same_steps(greedy(adapted, inputs, use_flash_attention=True), greedy(adapted, inputs))


def test_the_compressed_cache_survives_copies_and_pickling():
    ours, stock = family_pair("deepseek_v3")
    inputs = left_padded_batch([12, 5, 9])
    expected = greedy(stock, inputs)
    for clone in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        layers = [module for module in clone.modules() if hasattr(module, "kv_b_proj")]
        assert layers and all(isinstance(vars(layer)["expand_kv"], KeepCompressed) for layer in layers)
        assert_same_steps(greedy(clone, inputs, use_flash_attention=True), expected)


def test_a_compiled_decode_step_keeps_the_absorbed_attention_in_one_graph():
    ours, _ = family_pair("deepseek_v3")
    inputs = left_padded_batch([12, 5, 9])
    cache = DynamicCache(config=ours.config)
    with torch.no_grad():
        ours(**inputs, past_key_values=cache, use_cache=True, use_flash_attention=True)
        step = {
            "input_ids": inputs["input_ids"][:, -1:],
            "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(3, 1, dtype=torch.long)], -1),
        }
        eager_cache = copy.deepcopy(cache)
        expected = ours(**step, past_key_values=eager_cache, use_cache=True, use_flash_attention=True).logits
        torch._dynamo.reset()
        compiled = torch.compile(ours, fullgraph=True, backend="eager")
        logits = compiled(**step, past_key_values=cache, use_cache=True, use_flash_attention=True).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


class ValueScalingAttention(DeepseekV3Attention):
    """A user's subclass that does something with the values besides handing them to the attention."""

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        kv_nope = torch.zeros(1)
        k_rot = torch.zeros(1)
        key_states, value_states = self.expand_kv(kv_nope, k_rot)
        value_states = value_states * 2
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)  # noqa: F821
        return attention_interface(self, hidden_states, key_states, value_states, attention_mask, **kwargs)


class OwnExpansionAttention(DeepseekV3Attention):
    """A user's subclass with an expansion of its own."""

    def expand_kv(self, kv_nope, k_rot):
        key_states, value_states = super().expand_kv(kv_nope, k_rot)
        return key_states, value_states * 2


def test_a_module_qualifies_by_its_code():
    assert hands_expanded_latent(DeepseekV3Attention)
    assert not hands_expanded_latent(ValueScalingAttention)
    assert not hands_expanded_latent(OwnExpansionAttention)
    assert not hands_expanded_latent(torch.nn.Linear)


def test_expanded_is_the_familys_own_expansion():
    module, _, latent, rotary_key = latent_inputs(1, 7)
    key, value = expanded(module, latent, rotary_key)
    expected_key, expected_value = DeepseekV3Attention.expand_kv(module, latent, rotary_key)
    assert torch.equal(key, expected_key) and torch.equal(value, expected_value)


@pytest.mark.parametrize("companion", ["flash_attention_recompute", "flash_attention_fast_softmax"])
def test_a_short_prompt_with_a_prompt_companion_runs_the_fused_kernel(companion, monkeypatch):
    """A prompt short enough to absorb, with a companion that acts on the fused kernel's prompt: the fused kernel
    runs it (and the companion with it); decode steps, which both leave exact, still absorb."""
    ours, _ = family_pair("deepseek_v3")
    absorbed, fused, fuse = record_absorbed_rows(monkeypatch), [], attention.fused_sdpa
    monkeypatch.setattr(attention, "fused_sdpa", lambda q, *a, **k: fused.append(q.shape[2]) or fuse(q, *a, **k))
    inputs = {"input_ids": torch.randint(3, 60, (1, 12), generator=torch.Generator().manual_seed(0))}
    ours.generate(**inputs, max_new_tokens=3, do_sample=False, use_flash_attention=True, **{companion: True})
    assert fused == [12] * ours.config.num_hidden_layers and set(absorbed) == {1}
    absorbed.clear(), fused.clear()
    ours.generate(**inputs, max_new_tokens=3, do_sample=False, use_flash_attention=True)
    assert fused == [] and absorbed.count(12) == ours.config.num_hidden_layers
