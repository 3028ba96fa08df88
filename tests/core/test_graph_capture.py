"""Every family, flag on and off, traces like stock's class: no host read inside the decoder layers, at most one per
forward more than stock's, one graph under `torch.compile(fullgraph=True)` with eager's outputs, and that graph
serves another batch of the same shapes (other padding, other packing) without recompiling.

`backend="eager"` traces with dynamo exactly as inductor would receive the graph, without inductor's compile time.
"""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

from optimum.habana import gaudi_model_class
from optimum.habana.utils.graph_capture import HostReads, graph_report
from tests.helpers import FAMILIES, build_pair, in_make_test, left_padded_batch, tiny_config


def right_padded(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    return {name: tensor.flip(-1) for name, tensor in left_padded_batch(lengths, seed).items()}


def packed(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(3, 256, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    return {"input_ids": input_ids, "position_ids": position_ids}


def with_holes(seed: int = 0) -> dict[str, torch.Tensor]:
    batch = left_padded_batch([8, 8, 8], seed)
    batch["attention_mask"][1, 2:4] = 0  # padding in the middle of a row
    return batch


# Two batches of the same shapes per mode: the second must run in the first one's graph.
MODES = {
    "prompt, no padding": (left_padded_batch([8, 8]), left_padded_batch([8, 8], seed=1)),
    "prompt, left-padded": (left_padded_batch([8, 5, 3]), left_padded_batch([4, 8, 6], seed=1)),
    "prompt, right-padded": (right_padded([8, 5, 3]), right_padded([4, 8, 6], seed=1)),
    "prompt, padding anywhere": (with_holes(), left_padded_batch([8, 2, 7], seed=1)),
    "training, padding-free packed": (packed([5, 3, 4]), packed([2, 9, 1], seed=1)),
}
TRAINING = {"training, padding-free packed"}


def model_of(model_type: str, layers: int = 2, flag: bool | None = True, **overrides):
    torch.manual_seed(0)
    model = gaudi_model_class(model_type)(tiny_config(model_type, num_hidden_layers=layers, **overrides))
    if flag is not None:
        model.generation_config.use_flash_attention = flag
    return model


def stock_of(model_type: str, layers: int = 2):
    torch.manual_seed(0)
    return gaudi_model_class(model_type).__bases__[-1](tiny_config(model_type, num_hidden_layers=layers))


def host_reads(model, inputs: dict[str, torch.Tensor], training: bool) -> int:
    model.train(training)
    with HostReads() as reads:
        output = model(**{"labels": inputs["input_ids"], **inputs}, use_cache=False)
        if training:
            output.loss.backward()
    return reads.total


# Each family on the mode that read the host once per layer; Llama and a windowed family on every mode.
HOST_READ_CASES = [(model_type, "prompt, left-padded") for model_type in FAMILIES] + [
    (model_type, mode)
    for model_type in ("llama", "mistral")
    for mode in ("prompt, right-padded", "prompt, padding anywhere", "training, padding-free packed")
]


@pytest.mark.parametrize(("model_type", "mode"), HOST_READ_CASES)
def test_no_host_read_inside_the_layers(model_type, mode):
    """The same reads with 2 and 4 decoder layers (none per layer), and at most stock's plus one per forward."""
    inputs, training = MODES[mode][0], mode in TRAINING
    with torch.set_grad_enabled(training):
        stock = host_reads(stock_of(model_type), inputs, training)
        for flag in (False, True):
            reads = [host_reads(model_of(model_type, layers, flag), inputs, training) for layers in (2, 4)]
            assert reads[0] == reads[1], f"flag {flag}: {reads} host reads with 2 and 4 layers: one inside a layer"
            assert reads[0] <= stock + 1, f"flag {flag}: {reads[0]} host reads per forward, stock {stock}"


def compiled_once(model, batches, training: bool = False):
    """Each batch through one `fullgraph=True` compile of the model (backend "eager"); the outputs, and the graphs
    dynamo built for all of them."""
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    compiled = torch.compile(model, fullgraph=True, backend="eager", dynamic=False)
    outputs = []
    for inputs in batches:
        model.train(training)
        model.zero_grad()
        output = compiled(**{"labels": inputs["input_ids"], **inputs}, use_cache=False)
        if training:
            output.loss.backward()
            outputs.append((output.loss.detach(), next(model.parameters()).grad.clone()))
        else:
            outputs.append(output.logits.detach())
    return outputs, counters["stats"]["unique_graphs"] - before


def eager_outputs(model, batches, training: bool = False):
    outputs = []
    for inputs in batches:
        model.train(training)
        model.zero_grad()
        output = model(**{"labels": inputs["input_ids"], **inputs}, use_cache=False)
        if training:
            output.loss.backward()
            outputs.append((output.loss.detach(), next(model.parameters()).grad.clone()))
        else:
            outputs.append(output.logits.detach())
    return outputs


def assert_same_at_real_positions(compiled, eager, batches) -> None:
    for ours, reference, inputs in zip(compiled, eager, batches, strict=True):
        if isinstance(ours, tuple):  # training: loss and a gradient
            for a, b in zip(ours, reference, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            continue
        real = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
        torch.testing.assert_close(ours[real], reference[real], rtol=1e-5, atol=1e-5)


# Llama's plain attention, Mistral's window, Gemma 2's soft cap (the default path); the other families under `families`
@pytest.mark.parametrize("model_type", in_make_test(FAMILIES, kept={"llama", "mistral", "gemma2"}))
def test_every_family_compiles_a_padded_prompt_in_one_graph_for_any_padding(model_type):
    """The mode that broke the graph per layer: a left-padded prompt with the flag."""
    batches = MODES["prompt, left-padded"]
    model = model_of(model_type).eval()
    with torch.no_grad():
        compiled, graphs = compiled_once(model, batches)
        assert graphs == 1
        assert_same_at_real_positions(compiled, eager_outputs(model, batches), batches)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    ("model_type", "flag"),
    [
        pytest.param("llama", True, id="llama-flag on"),
        pytest.param("llama", False, id="llama-flag off"),
        pytest.param("mistral", True, id="mistral-flag on"),  # the window on the flag's planned masks
        pytest.param("mistral", False, id="mistral-flag off", marks=pytest.mark.families),
    ],
)
def test_every_mode_compiles_in_one_graph_for_any_batch_of_its_shapes(model_type, flag, mode):
    overrides = {"sliding_window": 4} if model_type == "mistral" else {}  # windows shorter than the prompts
    batches, training = MODES[mode], mode in TRAINING
    model = model_of(model_type, flag=flag, **overrides)
    with torch.set_grad_enabled(training):
        compiled, graphs = compiled_once(model, batches, training)
        assert graphs == 1
        assert_same_at_real_positions(compiled, eager_outputs(model, batches, training), batches)


def test_causal_mask_mode_and_gradient_checkpointing_compile_in_one_graph():
    model = model_of("llama")
    model.generation_config.flash_attention_causal_mask = True
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batches = (right_padded([8, 5, 3]), right_padded([4, 8, 6], seed=1))
    for batch in batches:
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    compiled, graphs = compiled_once(model, batches, training=True)
    assert graphs == 1
    assert_same_at_real_positions(compiled, eager_outputs(model, batches, training=True), batches)


def test_graph_report_names_a_graph_break():
    """The check users run on their own models (docs/graph_capture.md): it finds a break and says where."""
    model = model_of("llama").eval()
    inputs = MODES["prompt, left-padded"][0]
    with torch.no_grad():
        layer = model.model.layers[0].self_attn
        original = layer.forward

        def reads_the_host(*args, **kwargs):
            if bool(kwargs["attention_mask"].any()):  # a data-dependent branch
                return original(*args, **kwargs)
            return original(*args, **kwargs)

        layer.forward = reads_the_host
        report = graph_report(model, **inputs)
    assert not report.one_graph and report.graph_breaks >= 1
    assert "Data dependent" in report.describe() or "item" in report.describe()


def test_subclasses_with_more_bases_find_the_stock_class():
    """`class MyLlama(GaudiLlamaForCausalLM, SomeMixin)`, as transformers' own tests build them."""
    from transformers import GenerationMixin, LlamaForCausalLM

    from optimum.habana import GaudiLlamaForCausalLM

    class MyLlama(GaudiLlamaForCausalLM, GenerationMixin):
        pass

    model = MyLlama(tiny_config("llama"))
    assert MyLlama.forward.__annotations__["return"] is LlamaForCausalLM.forward.__annotations__["return"]
    assert model(**left_padded_batch([4, 2]), use_flash_attention=True).logits.shape == (2, 4, 256)


def test_compiled_decode_reuses_its_graph_for_other_padding():
    """generate()'s own compile of the static-cache decode step (fullgraph): one graph for both batches."""
    ours, _ = build_pair("llama")
    compile_config = CompileConfig(fullgraph=True, backend="eager", dynamic=False)
    compile_config._compile_all_devices = True  # CPU is skipped otherwise
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for seed, lengths in enumerate(([9, 4, 7], [3, 9, 8])):
        inputs = left_padded_batch(lengths, seed=seed)
        arguments = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        expected = ours.generate(**inputs, **arguments, cache_implementation="static")
        tokens = ours.generate(
            **inputs,
            **arguments,
            cache_implementation="static",
            compile_config=compile_config,
            use_flash_attention=True,
        )
        assert torch.equal(tokens, expected)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_continuous_batching_step_compiled_by_the_engine_breaks_only_where_stock_does():
    """transformers' engine compiles its step (`varlen_compile_config`); its paged cache's `update` is
    `torch.compiler.disable`d, a break stock's class has too. With the flag the step adds none of its own, reads no
    mask, and answers as generate() does."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from tests.core.test_continuous_batching import by_request, greedy_config, models, one_by_one

    ours, _ = models("llama")
    requests = [torch.arange(5, 25).tolist(), [8, 9, 10], torch.arange(50, 62).tolist()]
    expected = one_by_one(ours, requests)
    step = CompileConfig(backend="eager", dynamic=False)
    engine = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=16, varlen_compile_config=step)
    torch._dynamo.reset()
    counters.clear()
    outputs = ours.generate_batch(
        inputs=requests, generation_config=greedy_config(use_flash_attention=True), continuous_batching_config=engine
    )
    assert by_request(outputs) == expected
    reasons = {reason.splitlines()[0] for reason in counters["graph_break"]}
    assert reasons == {"Skip inlining `torch.compiler.disable()`d function"}
    assert all("PagedAttentionCache.update" in reason for reason in counters["graph_break"])


@pytest.mark.families  # inductor's compile time (about 20 s): in make test-families
def test_inductor_compiled_training_with_the_flag_follows_the_sequence_lengths():
    """The third length is the first that torch.compile compiles with a dynamic length: the backward of a sliced
    one-row query (the last padding position's call, which a graph plans without reading the padding) once failed
    there in inductor's stride check. Losses and gradients are eager's at each length."""
    ours, _ = build_pair("llama", num_hidden_layers=1)
    compiled = torch.compile(ours.train())
    for length in (20, 17, 13):
        input_ids = torch.randint(3, 200, (2, length), generator=torch.Generator().manual_seed(length))
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids}
        ours.zero_grad()
        expected = ours(**inputs, use_flash_attention=True).loss
        expected.backward()
        expected_gradients = {name: parameter.grad.clone() for name, parameter in ours.named_parameters()}
        ours.zero_grad()
        loss = compiled(**inputs, use_flash_attention=True).loss
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for name, parameter in ours.named_parameters():
            torch.testing.assert_close(parameter.grad, expected_gradients[name], rtol=1e-4, atol=1e-5, msg=name)


def test_torch_jit_trace_of_a_grouped_query_forward_with_the_flag():
    """torch.jit.trace (stock's SDPA traces): a traced size is a tensor, which PyTorch's kernel choice refused as
    `enable_gqa`. The trace gives eager's logits."""
    ours, _ = build_pair("llama")
    assert ours.config.num_key_value_heads < ours.config.num_attention_heads
    inputs = left_padded_batch([7, 7])

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = ours

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.model(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False, use_flash_attention=True
            ).logits

    with torch.no_grad(), pytest.warns(torch.jit.TracerWarning):
        traced = torch.jit.trace(Logits(), (inputs["input_ids"], inputs["attention_mask"]), check_trace=False)
        torch.testing.assert_close(traced(inputs["input_ids"], inputs["attention_mask"]), Logits()(**inputs))
