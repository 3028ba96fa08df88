"""The CUDA path on a CUDA device: what the CPU suite cannot run, PyTorch's CUDA attention kernels behind the flag.

Skipped without a GPU. `.ci/cuda-check` installs the checkout on a CUDA machine that has no network (the GPU this
workplace sometimes lends: its image holds PyTorch, not this package's transformers) and runs these in one call.
`CUDA_CHECK_DEVICE=cpu` runs them on the CPU instead, which checks the checks where no GPU is lent.
"""

import os

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, LlamaConfig

from optimum.habana import gaudi_model_class
from optimum.habana.utils.devices import memory_stats, reset_peak_memory, synchronize
from tests.core.test_continuous_batching import one_by_one, prompts, served_with_the_flag
from tests.families.support import LENGTHS, assert_same_steps, family_pair, greedy
from tests.helpers import count_attention_paths, left_padded_batch


DEVICE = torch.device(os.environ.get("CUDA_CHECK_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device (.ci/cuda-check runs these)"
)

# Plain, sliding windows, alternating windows, sinks, latent attention (absorbed decode steps), MoE
FAMILIES = ["llama", "mistral", "gemma3_text", "gpt_oss", "deepseek_v3", "qwen3_moe"]

# The ATen operators of PyTorch's fused kernels, by device, and of its math fallback, which the flag never runs
FUSED_OPERATORS = {
    "cuda": {
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
    },
    "cpu": {"aten::_scaled_dot_product_flash_attention_for_cpu"},
}
MATH_OPERATOR = "aten::_scaled_dot_product_attention_math"


def on_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.to(DEVICE) for name, tensor in batch.items()}


def operators_run(function) -> set[str]:
    with torch.profiler.profile() as profile:
        function()
    return {event.name for event in profile.events()}


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("use_flash_attention", [True, False])
def test_every_step_of_a_padded_batch_gives_stock_eagers_logits_in_float32(model_type, use_flash_attention):
    ours, stock = (model.to(DEVICE) for model in family_pair(model_type))
    inputs = on_device(left_padded_batch(LENGTHS))
    assert_same_steps(greedy(ours, inputs, use_flash_attention=use_flash_attention), greedy(stock, inputs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_flag_runs_a_fused_kernel_for_every_call_and_never_the_math_one(dtype, monkeypatch):
    """A left-padded prompt of grouped heads and its decode steps: every attention call on the flag's fused dispatch
    (none on the default path: in float32 on CUDA the grouped heads are repeated for the memory-efficient kernel),
    PyTorch's fused kernels running (bfloat16: flash attention itself where the device has it), the math one never."""
    ours, _ = family_pair("llama")
    ours = ours.to(DEVICE, dtype)
    assert ours.config.num_key_value_heads < ours.config.num_attention_heads
    inputs = on_device(left_padded_batch(LENGTHS))
    with count_attention_paths(monkeypatch, profile=False) as counts:
        names = operators_run(lambda: greedy(ours, inputs, use_flash_attention=True))
    assert counts["fused"] > 0 and counts["default"] == 0, counts
    assert names & FUSED_OPERATORS[DEVICE.type] and MATH_OPERATOR not in names
    if dtype == torch.bfloat16 and DEVICE.type == "cuda":
        assert "aten::_scaled_dot_product_flash_attention" in names


def test_a_training_step_gives_stock_eagers_loss_and_gradients():
    ours, stock = (model.to(DEVICE).train() for model in family_pair("llama"))
    batch = on_device(left_padded_batch([16, 16]))
    labels = batch["input_ids"].clone()
    losses = []
    for model, flags in ((ours, {"use_flash_attention": True}), (stock, {})):
        loss = model(**batch, labels=labels, **flags).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    stock_gradients = dict(stock.named_parameters())
    for name, parameter in ours.named_parameters():
        torch.testing.assert_close(parameter.grad, stock_gradients[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_continuous_batching_serves_each_request_its_own_generate_tokens():
    ours, _ = family_pair("llama")
    ours = ours.to(DEVICE)
    requests = prompts() + [[5]]  # a one-token prompt beside longer ones
    assert served_with_the_flag(ours, requests) == one_by_one(ours, requests)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="reads the CUDA allocator's peak")
def test_a_long_prompt_holds_no_score_matrix():
    """One layer of 8 heads over 8192 tokens: the default path holds the 8 x 8192 x 8192 fp32 scores (2 GiB), the
    flag's kernels none of it. The layer's own activations (about 150 MiB: residual, q, k, v and the rotary
    temporaries, 16 MiB each) stay below an eighth of the scores."""
    config = LlamaConfig(
        vocab_size=256, hidden_size=512, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8
    )
    model = gaudi_model_class("llama")(config).to(DEVICE).eval()
    input_ids = torch.randint(3, 256, (1, 8192), device=DEVICE)
    extra = {}
    for flag in (True, False):
        synchronize(DEVICE)
        reset_peak_memory(DEVICE)
        before = memory_stats(DEVICE)["allocated"]
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1, use_flash_attention=flag)
        synchronize(DEVICE)
        extra[flag] = memory_stats(DEVICE)["max_allocated"] - before
    scores = 8 * 8192 * 8192 * 4
    assert extra[False] >= scores and extra[True] < scores / 8, extra


def test_generates_compiled_decode_step_gives_the_uncompiled_logits():
    """generate()'s own compile of the static-cache decode step (fullgraph, inductor on CUDA; the CPU self-check
    traces only), with the flag."""
    ours, _ = family_pair("llama")
    ours = ours.to(DEVICE)
    inputs = on_device(left_padded_batch(LENGTHS))
    expected = greedy(ours, inputs, use_flash_attention=True, cache_implementation="static")
    compile_config = CompileConfig(
        fullgraph=True, dynamic=False, backend="inductor" if DEVICE.type == "cuda" else "eager"
    )
    compile_config._compile_all_devices = True  # generate() compiles on CUDA only, otherwise
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    found = greedy(
        ours, inputs, use_flash_attention=True, cache_implementation="static", compile_config=compile_config
    )
    assert counters["stats"]["unique_graphs"] - graphs == 1  # the decode step, once
    assert_same_steps(found, expected)
