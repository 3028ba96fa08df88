"""Every qualifying family beyond the prompt: a static-cache generate, a training step, a packed training step, a
one-sequence decode with its context cut for idle threads, decode steps on the decode kernel, and continuous batching.

These run outside `make test`, in `.ci/run` (`make test-families`, about a minute on 2 cores), under the
`families` marker, which keeps `make test` clear of its 8-minute budget. What they hold each family to is what the
14 written families are held to in tests/core.
"""

import pytest
import torch
from transformers import DataCollatorWithFlattening, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION

from optimum.habana import gaudi_model_class, supported_model_types
from optimum.habana.kernels import cpu_decode, dispatch, split_context
from optimum.habana.transformers import paged_attention
from optimum.habana.transformers.batch_layout import can_run_packed, local_layers_run_planned
from optimum.habana.transformers.continuous_batching import check_engine_serves
from optimum.habana.transformers.families.lookups import family_runs_mask_free
from optimum.habana.transformers.families.qualification import SOFTCAP
from optimum.habana.transformers.latent_attention import receives_compressed_latent
from optimum.habana.transformers.models import family_table
from tests.families.support import LENGTHS, NEW_TOKENS, assert_same_steps, family_pair, greedy
from tests.families.tiny_configs import without_dropout
from tests.helpers import count_context_cuts, count_decode_kernel_calls, left_padded_batch, record_absorbed_rows


pytestmark = pytest.mark.families


def one_model_type_per_class() -> list[str]:
    """Model types that share a class (`llama4` and `llama4_text`) are one family here. Read off the family table
    (cached on disk), so that collecting this module, which `make test` does too, judges and builds no class."""
    table = family_table()
    seen, kept = set(), []
    for model_type in supported_model_types():
        if table[model_type].class_name not in seen:
            seen.add(table[model_type].class_name)
            kept.append(model_type)
    return kept


FAMILY_TYPES = one_model_type_per_class()


def training_pair(model_type: str, reference_attention: str | None = "eager"):
    config_class = gaudi_model_class(model_type).config_class
    ours, stock = family_pair(model_type, reference_attention, **without_dropout(config_class))
    # A random model keeps a zero embedding row at the padding id (nn.Embedding's padding_idx), as checkpoints may:
    # the padding rows' hidden states start exactly at zero, where Gemma 3n's epsilon-free magnitude
    # (`mean(h ** 2) ** 0.5`) once gave NaN gradients with the flag (the fused path zeroed those rows' attention).
    return ours.train(), stock.train()


def right_padded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same rows with their padding moved to the right."""
    order = torch.argsort(1 - batch["attention_mask"], dim=1, stable=True)
    return {name: tensor.gather(1, order) for name, tensor in batch.items()}


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: parameter.grad for name, parameter in model.named_parameters() if parameter.grad is not None}


def assert_same_gradients(ours, stock) -> None:
    """The gradients of two models, or two dicts of them (`gradients`), within 1e-4 of the expected's scale."""
    expected = stock if isinstance(stock, dict) else gradients(stock)
    found = ours if isinstance(ours, dict) else gradients(ours)
    assert found.keys() == expected.keys()
    for name, gradient in expected.items():
        scale = max(1.0, gradient.nan_to_num().abs().max().item())
        # Not compared where stock's gradient is NaN (Gemma 3n's epsilon-free norm of an all-zero padding row, under
        # stock SDPA); a NaN of ours where stock's is finite fails.
        difference = (found[name] - gradient).abs().masked_fill(gradient.isnan(), 0.0)
        assert difference.max() <= 1e-4 * scale, name


# Families whose stock static cache gives other logits than its dynamic one by a defect of transformers' that the
# Gaudi static cache does not share: their reference is stock's dynamic cache (tests/core/test_generation_features.py).
STOCK_STATIC_CACHE_DEFECTS = {"inkling_text": "query positions counted from a length `update` advanced in place"}


@pytest.mark.parametrize("lengths", [LENGTHS, LENGTHS[:1]], ids=["padded", "one_row"])
@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_static_cache_generate_gives_stock_tokens(model_type, lengths):
    """A padded batch, and one unpadded row: a prompt whose layers get no mask, with keys for every slot of the
    cache."""
    ours, stock = family_pair(model_type)
    inputs = left_padded_batch(lengths)
    try:
        reference = greedy(stock, inputs, cache_implementation="static")
    except Exception as stock_error:  # the family itself has no static cache (linear-attention layers, say)
        with pytest.raises(type(stock_error)):
            greedy(ours, inputs, cache_implementation="static", use_flash_attention=True)
        return
    if model_type in STOCK_STATIC_CACHE_DEFECTS:
        dynamic = greedy(stock, inputs)
        with pytest.raises(AssertionError):  # still there: else the family leaves STOCK_STATIC_CACHE_DEFECTS
            assert_same_steps(reference, dynamic)
        reference = dynamic
    assert_same_steps(greedy(ours, inputs, cache_implementation="static", use_flash_attention=True), reference)
    assert_same_steps(greedy(ours, inputs, cache_implementation="static"), reference)


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_right_padded_generate_gives_stock_steps(model_type):
    """generate() continues a right-padded prompt (transformers warns against it) from each row's last position, a
    padding one in the shorter rows: with the flag, the tokens and every step's logits are still stock's."""
    ours, stock = family_pair(model_type)
    # Each shorter row keeps a real token within its last position's window and chunk (8 tokens): a query with no
    # key to attend to gets zero from stock sdpa and the Gaudi paths, the average of every value from stock eager.
    inputs = right_padded(left_padded_batch([12, 10, 9]))
    assert_same_steps(greedy(ours, inputs, use_flash_attention=True), greedy(stock, inputs))


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_one_sequence_decode_cut_for_idle_threads_gives_stock_tokens(model_type, monkeypatch):
    """The context cut of a one-sequence CPU decode step (`kernels/split_context.py`), made to run for every family:
    64 threads as far as the decision sees (any head count leaves most idle), pieces of 4 tokens, and the CPU decode
    kernel, which runs fp32 decode steps before the cut is considered, turned off."""
    monkeypatch.setenv(cpu_decode.ENV_VAR, "0")
    monkeypatch.setattr(split_context, "MIN_PIECE_TOKENS", 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    cuts = count_context_cuts(monkeypatch)
    ours, stock = family_pair(model_type)
    inputs = left_padded_batch([14])
    reference = greedy(stock, inputs)
    assert_same_steps(greedy(ours, inputs, use_flash_attention=True), reference)
    # Each call with equal query, key and value head sizes on the fused path is cut; a latent-attention decode step
    # (value heads of another size) goes whole, and soft-capped logits take the default path.
    may_go_whole = {"soft-capped logits", "latent attention (value head size differs from the query's)"}
    assert cuts or may_go_whole & set(family_table()[model_type].variants)


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_decode_steps_on_the_cpu_decode_kernel_give_stock_tokens(model_type, monkeypatch):
    """fp32 decode steps on CPU run on the decode kernel (`kernels/cpu_decode.py`), padded batch included."""
    if cpu_decode.environment_problem() is not None:
        pytest.skip(f"no decode kernel here: {cpu_decode.environment_problem()}")
    calls = count_decode_kernel_calls(monkeypatch)
    decode_paths = []
    decide = dispatch.kernel_path

    def recorded(query, *args, **kwargs):
        path = decide(query, *args, **kwargs)
        if query.shape[2] == 1:
            decode_paths.append(path)
        return path

    monkeypatch.setattr(dispatch, "kernel_path", recorded)
    absorbed_rows = record_absorbed_rows(monkeypatch)
    ours, stock = family_pair(model_type)
    inputs = left_padded_batch(LENGTHS)
    reference = greedy(stock, inputs)
    assert_same_steps(greedy(ours, inputs, use_flash_attention=True), reference)
    variants = family_table()[model_type].variants
    if any(map(receives_compressed_latent, ours.modules())):  # its steps read the compressed cache (kernels/latent.py)
        assert absorbed_rows.count(1) >= NEW_TOKENS - 1
    # sinks run on the kernel as they are, with no copy as long as the context (no sink key); soft-capped logits
    # take the default path
    assert calls or "soft-capped logits" in variants or absorbed_rows
    assert all(path.kernel == "cpu_decode" and not path.sink_key and not path.equal_widths for path in decode_paths)


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_continuous_batching_reads_the_paged_cache_in_place_and_gives_generates_tokens(model_type, monkeypatch):
    """Every family transformers' engine serves: with the flag, each request's greedy fp32 tokens are the stock
    class's generate()'s (eager attention), none fails, and its full-attention layers' decode rows read the paged cache
    in place (`paged_attention.py`) where only the attention reads the masks and no sink or soft cap takes them
    elsewhere. A family it cannot serve is refused before any request, by a fact of its code, with its reason."""
    ours, stock = family_pair(model_type)
    calls = family_table()[model_type].calls_per_attention
    if calls > 1:  # each call would write the cache: refused
        with pytest.raises(ValueError, match=f"calls the attention function {calls} times per layer"):
            check_engine_serves(ours)
    try:
        check_engine_serves(ours)
    except ValueError as refusal:
        pytest.skip(str(refusal))
    generator = torch.Generator().manual_seed(3)
    requests = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in LENGTHS]
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0, use_flash_attention=True
    )
    stock_config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    expected = [
        stock.generate(torch.tensor([ids]), generation_config=stock_config)[0, len(ids) :].tolist() for ids in requests
    ]
    in_place = []
    attend = paged_attention.paged_decode_sdpa
    monkeypatch.setattr(
        paged_attention, "paged_decode_sdpa", lambda *args, **kwargs: in_place.append(1) or attend(*args, **kwargs)
    )
    engine = ContinuousBatchingConfig(page_size=16, num_blocks=48, max_batch_tokens=64)
    outputs = ours.generate_batch(requests, generation_config=config, continuous_batching_config=engine)
    ordered = sorted(outputs.values(), key=lambda output: int(output.request_id.rsplit("_", 1)[-1]))
    assert [output.error for output in ordered] == [None] * len(requests)
    found = [output.generated_tokens for output in ordered]
    if found != expected:  # unless stock's own engine differs from its generate() (Moshi's applies the config's
        # window, which its layers do not): the engine is stock's, and ours must give what it gives the stock class
        stock.set_attn_implementation("sdpa")
        stock_outputs = stock.generate_batch(
            requests, generation_config=stock_config, continuous_batching_config=engine
        )
        expected = [
            output.generated_tokens
            for output in sorted(stock_outputs.values(), key=lambda output: int(output.request_id.rsplit("_", 1)[-1]))
        ]
    assert found == expected
    variants = set(family_table()[model_type].variants)
    full_layers = FULL_ATTENTION in group_layers_by_attn_type(ours.config)
    reads_in_place = full_layers and local_layers_run_planned(ours.config) and SOFTCAP not in variants
    if cpu_decode.environment_problem() is None:
        assert bool(in_place) == reads_in_place


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_training_step_gives_stock_loss_and_gradients(model_type):
    ours, stock = training_pair(model_type)
    inputs = right_padded(left_padded_batch(LENGTHS, seed=1))  # training pads on the right: no pad position is scored
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    expected = stock(**inputs, labels=labels, use_cache=False).loss
    expected.backward()
    loss = ours(**inputs, labels=labels, use_cache=False, use_flash_attention=True).loss
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5
    assert_same_gradients(ours, stock)


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_left_padded_training_step_gives_the_same_loss_with_the_flag_and_stocks_where_it_can(model_type):
    """Left padding reaches the loss: the last padding position, whose query attends to no key, predicts the first
    real token. The flag changes neither the loss nor the gradients. Both are the stock default attention's (the
    one the config names, as for ours) where its masks give that row what the flag does: SDPA's zero from a boolean
    mask, or the values' average from a float mask that every call reads, flag or not (Doge's dynamic mask,
    Inkling's position bias, a family never planned). An eager-only family whose padded prompts the flag plans
    (Gemma 2) keeps the plan's zero, where stock eager averages (docs/drop_in.md)."""
    ours, stock = training_pair(model_type, reference_attention=None)  # the stock default attention
    inputs = left_padded_batch(LENGTHS, seed=1)
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    default_path = ours(**inputs, labels=labels, use_cache=False).loss
    default_path.backward()
    without_flag = {name: gradient.clone() for name, gradient in gradients(ours).items()}
    ours.zero_grad(set_to_none=True)
    fused = ours(**inputs, labels=labels, use_cache=False, use_flash_attention=True).loss
    fused.backward()
    assert abs(fused.item() - default_path.item()) <= 1e-5
    assert_same_gradients(ours, without_flag)
    if stock.config._attn_implementation == "sdpa" or not family_runs_mask_free(model_type):
        expected = stock(**inputs, labels=labels, use_cache=False).loss
        expected.backward()
        assert abs(default_path.item() - expected.item()) <= 1e-5
        assert_same_gradients(without_flag, stock)


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_packed_training_step(model_type):
    """Where the family runs packed (`can_run_packed`), each example as alone, as the written families do; elsewhere
    the batch as stock transformers' eager attention computes it (the examples see each other, as with stock SDPA)."""
    ours, stock = training_pair(model_type)
    generator = torch.Generator().manual_seed(2)
    features = [{"input_ids": torch.randint(3, 256, (length,), generator=generator).tolist()} for length in (7, 5)]
    for feature in features:
        feature["labels"] = feature["input_ids"]
    batch = DataCollatorWithFlattening()(features)
    loss = ours(**batch, use_flash_attention=True).loss
    loss.backward()
    if can_run_packed(ours.config):
        predicted = sum(len(feature["input_ids"]) - 1 for feature in features)
        expected = 0.0
        for feature in features:
            ids = torch.tensor([feature["input_ids"]])
            alone = stock(input_ids=ids, labels=ids).loss * (ids.shape[1] - 1) / predicted
            alone.backward()
            expected += alone.item()
    else:
        stock_loss = stock(**batch).loss
        stock_loss.backward()
        expected = stock_loss.item()
    assert abs(loss.item() - expected) <= 1e-5
    assert_same_gradients(ours, stock)
