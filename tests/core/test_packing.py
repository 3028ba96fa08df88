"""Padding-free packed batches (`DataCollatorWithFlattening`): every example isolated exactly, no N x N mask.

Each packed example must get the logits, the loss and the LoRA gradients it gets alone, with the flag and
without, whether the batch carries `position_ids` alone or FlashAttention's `cu_seq_lens_*` too, and whether the
model builds a KV cache (the default `use_cache=True`, under which stock transformers lets the examples see each
other). With the flag, the kernel runs once per example and no mask reaches it.
"""

import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import DataCollatorWithFlattening

from optimum.habana.cli.finetuning.modeling import attention_projections
from optimum.habana.kernels import variable_length
from optimum.habana.kernels.variable_length import Segment
from optimum.habana.transformers import attention, batch_layout, planned_masks, registration
from tests.helpers import FAMILIES, SLIDING_WINDOW_CONFIGS, SOFT_CAPPED, build_pair


LENGTHS = [7, 12, 5, 9]


def examples(seed: int = 0) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in LENGTHS]
    return [{"input_ids": row, "labels": row} for row in rows]


def lora_model(model_type: str, **overrides):
    ours, _ = build_pair(model_type, **overrides)
    targets = attention_projections(ours)
    model = get_peft_model(ours, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    return model.train()


def lora_gradients(model) -> dict[str, torch.Tensor]:
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}


def packed_and_alone(model, features, flash_kwargs: bool, **call):
    """Logits and LoRA gradients of the packed batch, and the same from each example alone."""
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(features)
    model.zero_grad()
    packed = model(**batch, **call)
    packed.loss.backward()
    packed_gradients = lora_gradients(model)

    model.zero_grad()
    predicted = sum(len(feature["input_ids"]) - 1 for feature in features)
    alone_logits, alone_loss = [], 0.0
    for feature in features:
        ids = torch.tensor([feature["input_ids"]])
        output = model(input_ids=ids, labels=ids, **call)
        # The packed loss is the mean over all predicted tokens: weigh each example's mean by its token count.
        weighted = output.loss * (ids.shape[1] - 1) / predicted
        weighted.backward()
        alone_loss += weighted.detach()
        alone_logits.append(output.logits[0])
    return (packed.logits[0], packed.loss.detach(), packed_gradients), (
        torch.cat(alone_logits),
        alone_loss,
        lora_gradients(model),
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_packed_example_gets_its_own_loss_and_gradients(model_type, flash_kwargs):
    model = lora_model(model_type, **SLIDING_WINDOW_CONFIGS.get(model_type, {}))
    features = examples()
    for call in ({}, {"use_flash_attention": True}):
        (logits, loss, gradients), (alone_logits, alone_loss, alone_gradients) = packed_and_alone(
            model, features, flash_kwargs, **call
        )
        torch.testing.assert_close(logits, alone_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss, alone_loss, rtol=1e-5, atol=1e-5)
        assert gradients.keys() == alone_gradients.keys() and len(gradients) > 0
        for name, gradient in gradients.items():
            torch.testing.assert_close(gradient, alone_gradients[name], rtol=1e-5, atol=1e-5, msg=name)


def test_stock_transformers_mixes_the_examples_that_we_isolate():
    """Why the Gaudi model reads the lengths itself: with a cache object (use_cache defaults to True) transformers
    does not detect the packing, and its examples attend to each other."""
    ours, stock = build_pair("llama")
    stock.config._attn_implementation = "sdpa"
    batch = DataCollatorWithFlattening()(examples())
    batch.pop("labels")
    ids = batch["input_ids"][:, LENGTHS[0] : LENGTHS[0] + LENGTHS[1]]
    with torch.no_grad():
        second_alone = stock(input_ids=ids).logits[0]
        stock_packed = stock(**batch).logits[0, LENGTHS[0] : LENGTHS[0] + LENGTHS[1]]
        ours_packed = ours(**batch, use_flash_attention=True).logits[0, LENGTHS[0] : LENGTHS[0] + LENGTHS[1]]
    assert not torch.allclose(stock_packed, second_alone, atol=1e-3)
    torch.testing.assert_close(ours_packed, second_alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_fused_packed_path_runs_one_maskless_call_per_example(model_type, flash_kwargs, monkeypatch):
    """What reaches the kernel: one causal call per example and layer, each of that example's length, no mask;
    transformers' mask construction and the default path's packed mask are never reached."""
    overrides = {"sliding_window": 64} if model_type == "mistral" else {}  # a window longer than every example
    ours, _ = build_pair(model_type, **overrides)
    calls = []
    kernel = variable_length.fused_sdpa

    def spy(query, key, value, mask, **kwargs):
        calls.append((query.shape[2], key.shape[2], mask, kwargs["is_causal"]))
        return kernel(query, key, value, mask, **kwargs)

    def no_mask_here(*args, **kwargs):
        raise AssertionError("an N x N mask was built for a packed batch on the fused path")

    monkeypatch.setattr(attention, "fused_sdpa", spy)  # any unpacked call would be counted too
    monkeypatch.setattr(variable_length, "fused_sdpa", spy)
    monkeypatch.setattr(variable_length, "segment_mask", no_mask_here)
    monkeypatch.setattr(planned_masks, "segment_mask", no_mask_here)
    monkeypatch.setattr(registration, "sdpa_mask", no_mask_here)
    ours.train()
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(examples())
    ours(**batch, use_flash_attention=True).loss.backward()
    layers = ours.config.num_hidden_layers
    assert calls == [(length, length, None, True) for _ in range(layers) for length in LENGTHS]


def test_default_path_reads_a_block_diagonal_mask_within_windows():
    tokens = torch.zeros(1, 5, dtype=torch.long)
    segments = batch_layout.packed_segments(torch.tensor([[0, 1, 2, 0, 1]]), None, tokens)
    mask = variable_length.segment_mask(segments, sliding_window=2)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 1, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected[None, None])


def bounds(lengths_per_row: list[list[int]]) -> tuple[Segment, ...]:
    segments = []
    for row, lengths in enumerate(lengths_per_row):
        start = 0
        for length in lengths:
            segments.append(Segment(row, start, start + length, start, start + length))
            start += length
    return tuple(segments)


def test_what_counts_as_packed():
    """On the host: position ids that restart, or FlashAttention's boundaries, read once into Python bounds."""
    tokens = torch.zeros(1, 6, dtype=torch.long)
    restart = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert batch_layout.packed_segments(restart, None, tokens).bounds == bounds([[3, 2, 1]])
    assert batch_layout.packed_segments(torch.arange(6)[None], None, tokens) is None
    boundaries = torch.tensor([0, 4, 6], dtype=torch.int32)
    assert batch_layout.packed_segments(None, boundaries, tokens).bounds == bounds([[4, 2]])
    two_rows = torch.tensor([[0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 0, 1]])
    assert batch_layout.packed_segments(two_rows, None, tokens.repeat(2, 1)).bounds == bounds([[2, 4], [4, 2]])
    # A padded batch is not packed: the decoder plans it as a padded prompt, whatever its position ids.
    config = build_pair("llama")[0].config
    kwargs = {"input_ids": tokens, "attention_mask": torch.ones(1, 6), "position_ids": restart}
    kwargs.update(use_flash_attention=True, flash_attention_causal_mask=False)
    assert "segments" not in batch_layout.plan_batch_layout(config, kwargs, torch.float32)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_soft_capped_family_falls_back_to_the_packed_mask():
    """Gemma 2's soft-capped layers take the default path, which must still isolate the examples."""
    assert "gemma2" in SOFT_CAPPED
    model = lora_model("gemma2", sliding_window=5)
    (logits, _, _), (alone_logits, _, _) = packed_and_alone(model, examples(1), False, use_flash_attention=True)
    torch.testing.assert_close(logits, alone_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen3_next", "bamba"])
def test_a_packed_batch_reaching_layers_with_a_running_state_is_said_once(model_type):
    """Linear-attention and state-space layers see no position id: a packed row carries each example's state into
    the next (stock too, silently). The docs' promise of per-example results cannot hold there: one line says so,
    naming the layers; a padded batch, one example per row, or a batch with the bounds the family reads, says nothing."""
    from optimum.habana import gaudi_model_class
    from optimum.habana.kernels import dispatch
    from tests.families.tiny_configs import tiny_family_config

    gaudi_class = gaudi_model_class(model_type)
    torch.manual_seed(0)
    model = gaudi_class(tiny_family_config(model_type, gaudi_class.config_class, vocab_size=256)).eval()
    packed = DataCollatorWithFlattening()(examples())
    layers = ", ".join(sorted(set(model.config.layer_types) - {"attention", "full_attention"}))
    dispatch.warn_once.cache_clear()
    for flag in (False, True):
        with warnings.catch_warnings(record=True) as record, torch.no_grad():
            warnings.simplefilter("always")
            model(**packed, use_flash_attention=flag)
        said = [str(warning.message) for warning in record if "packed batch" in str(warning.message)]
        assert said == ([] if flag else [  # once a process
            f"{model_type}: a packed batch (position ids restarting inside a row, no attention mask) reaches its "
            f"{layers} layers, whose state runs along the sequence: each example's state carries into the next (as "
            "in stock transformers), so its logits, loss and gradients are not those it gets alone. Pad the batch "
            "instead (with an attention mask)."
        ])  # fmt: skip
    dispatch.warn_once.cache_clear()
    ids = torch.tensor([examples()[1]["input_ids"]])
    quiet = [
        {"input_ids": ids, "position_ids": torch.arange(ids.shape[1])[None]},  # one example per row
        {"input_ids": ids[:, :6].repeat(2, 1), "attention_mask": torch.ones(2, 6, dtype=torch.long)},  # padded
        {**packed, "seq_idx": torch.zeros_like(packed["input_ids"], dtype=torch.int32)},  # the family's bounds
    ]
    for inputs in quiet:
        with warnings.catch_warnings(record=True) as record, torch.no_grad():
            warnings.simplefilter("always")
            try:
                model(**{key: value for key, value in inputs.items() if key != "labels"})
            except ValueError as error:  # the bounds given, without the kernels that take them: transformers says so
                assert "can't keep packed sequences apart" in str(error) and "seq_idx" in inputs
        assert not [warning for warning in record if "packed batch" in str(warning.message)], inputs.keys()
