"""Sequences split over processes (`context_parallel.py`): the exchange, the batch's split and plan, the refusals,
and one training step of each attention variant over two gloo processes against one process."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from optimum.habana import gaudi_model_class
from optimum.habana.cli.finetuning.sharding import explain_training
from optimum.habana.transformers.context_parallel import (
    DEEPSPEED_SEQUENCE_PARALLEL_STATE,
    ContextParallelError,
    SequenceSplit,
    context_parallel_refusal,
    key_value_replication,
    packed_batch_refusal,
    temperature_at_own_positions,
)
from optimum.habana.transformers.context_parallel.trainer import (
    ContextParallelTrainer,
    SplitBatches,
    check_context_parallel_model,
    check_fused_kernel_everywhere,
    check_world_size,
)
from tests.families.tiny_configs import tiny_family_config
from tests.helpers import FUSED_KERNEL_CPU, ROOT


WORKER = ROOT / "tests" / "core" / "context_parallel_worker.py"
# One case per attention variant and batch layout: "model_type:layout:flag[:kv=K]" (see the worker).
VARIANT_CASES = [
    "llama:padded:on",  # a left-padded row beside a full one
    "llama:padded:off",
    "llama:packed:on:kv=1",  # packed examples; one key/value head over two processes: repeated
    "mistral:padded:on",  # a sliding window shorter than the sequence
    "gemma3_text:packed:on",  # windows alternating with full attention, packed examples
    "gpt_oss:padded:on",  # sinks and alternating windows
    "deepseek_v3:padded:on",  # latent attention: the value head narrower than the query's
    "gemma4_text:padded:off",  # per-layer head counts and sizes
    "qwen3_moe:packed:on",  # a mixture of experts
    "llama4_text:padded:on",  # chunks across the processes' cut; a NoPE layer's queries scaled by their position
    "llama4_text:plain:on",  # the same, no padding on either side: the chunks stacked in one call, no mask
]
TOLERANCE = 1e-5  # fp32, relative: the split only reorders additions


def run_worker(output, cases: list[str]) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)]
    done = subprocess.run(
        [*command, str(output), ",".join(cases)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(output.read_text())


def assert_trained_as_one_process(record: dict) -> None:
    """The step's loss and every gradient, summed over the two processes, against the one-process step's."""
    assert abs(record["loss"] - record["expected_loss"]) <= TOLERANCE * record["expected_loss"]
    assert record["parameters"] > 0 and record["gradient_difference"] <= TOLERANCE


@pytest.fixture(scope="module")
def variant_records(tmp_path_factory) -> dict:
    return run_worker(tmp_path_factory.mktemp("context_parallel") / "records.json", VARIANT_CASES)


@pytest.mark.parametrize("case", VARIANT_CASES)
def test_two_processes_train_a_step_as_one_does(variant_records, case):
    record = variant_records[case]
    assert_trained_as_one_process(record)
    for paths in record["paths"]:  # every process ran its heads' attention, fused with the flag
        if case.split(":")[2] == "on":
            assert paths["fused"] > 0 and paths[FUSED_KERNEL_CPU] > 0 and "default" not in paths
        else:
            assert paths["default"] > 0 and "fused" not in paths


def test_the_split_pads_shifts_and_numbers_the_positions():
    batch = {
        "input_ids": torch.arange(10, 17)[None],
        "attention_mask": torch.ones(1, 7, dtype=torch.long),
        "labels": torch.arange(10, 17)[None],
    }
    first, second = SequenceSplit(None, 2, 0).shard(batch), SequenceSplit(None, 2, 1).shard(batch)
    assert first["input_ids"].tolist() == [[10, 11, 12, 13]] and second["input_ids"].tolist() == [[14, 15, 16, 0]]
    assert first["shift_labels"].tolist() == [[11, 12, 13, 14]]  # the next token, across the cut
    assert second["shift_labels"].tolist() == [[15, 16, -100, -100]]
    assert torch.equal(second["labels"], second["shift_labels"])
    assert second["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert second["attention_mask"].tolist() == [[1, 1, 1, 0]]


def test_a_process_gives_its_queries_the_temperature_of_its_own_positions(monkeypatch):
    """Llama 4's NoPE layers scale each query by its position counted from the call's first token: the second of two
    processes (positions 12 to 23) gets the scales of 0 to 11 from the layer, and those of 12 to 23 after the
    correction, as one process computes them over the whole sequence; in a graph without a break."""
    from transformers.models.llama4 import modeling_llama4

    config = tiny_family_config("llama4_text", gaudi_model_class("llama4_text").config_class)
    queries = []

    def capture(module, query, key, value, attention_mask, **kwargs):
        queries.append(query)
        return query.transpose(1, 2), None

    monkeypatch.setattr(modeling_llama4.ALL_ATTENTION_FUNCTIONS, "get_interface", lambda *args: capture)
    nope, rotary = (modeling_llama4.Llama4TextAttention(config, layer_idx=index) for index in (2, 1))
    assert nope.attn_temperature_tuning and not nope.use_rope and rotary.use_rope
    hidden_states = torch.randn(2, 24, config.hidden_size)
    with torch.no_grad():
        nope(hidden_states, None, None)
        nope(hidden_states[:, 12:], None, None)
    whole, own = queries
    assert not torch.allclose(own, whole[:, :, 12:])  # the scale varies along the sequence
    corrected = torch.compile(temperature_at_own_positions, backend="eager", fullgraph=True)(nope, own, 12)
    torch.testing.assert_close(corrected, whole[:, :, 12:])
    assert temperature_at_own_positions(rotary, own, 12) is own
    assert temperature_at_own_positions(nope, own, 0) is own


def test_key_value_heads_are_repeated_only_where_that_is_exact():
    assert key_value_replication(32, 8, 4) == 1
    assert key_value_replication(32, 2, 8) == 4  # each key/value head on four processes
    assert key_value_replication(12, 3, 2) == 2
    with pytest.raises(ContextParallelError) as error:
        key_value_replication(6, 3, 4)
    assert str(error.value) == (
        "6 query heads over 3 key/value heads cannot be split evenly over 4 processes (each process needs whole "
        "query heads beside their key/value heads): context parallel sizes that split them: 2, 3, 6."
    )


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        ("qwen3_next", "has linear_attention layers, whose state runs along the sequence"),
        ("lfm2_moe", "has conv layers, whose state runs along the sequence"),
        ("gpt2", "reads the attention mask outside its attention"),
    ],
)
def test_families_that_cannot_be_split_are_refused_by_name(model_type, reason):
    config = tiny_family_config(model_type, gaudi_model_class(model_type).config_class)
    assert reason in context_parallel_refusal(config)
    with pytest.raises(ContextParallelError, match=f"--context_parallel_size 2: the model type '{model_type}"):
        check_context_parallel_model(config, 2, "--context_parallel_size")


def test_a_family_whose_config_has_another_model_type_is_split():
    """Emu3's config carries the model type 'emu3_text_model', not its family's 'emu3': read as no family, it was
    refused as one that "reads the attention mask outside its attention". Its attention is plain causal attention,
    Llama's variant (`VARIANT_CASES`)."""
    config = tiny_family_config("emu3", gaudi_model_class("emu3").config_class)
    assert config.model_type == "emu3_text_model"
    assert context_parallel_refusal(config) is None
    check_context_parallel_model(config, 2, "--context_parallel_size")


def test_packed_batches_are_refused_before_the_weights_for_the_reason_the_first_step_gives(monkeypatch):
    """Llama 4's chunked layers take no packed examples: its first packed step is refused; the check made before the
    weights load (with the option that packs the batches) gives the same reason."""
    config = tiny_family_config("llama4_text", gaudi_model_class("llama4_text").config_class)
    reason = packed_batch_refusal(config)
    assert reason == (
        "a padding-free packed batch of the model type 'llama4_text': its chunked layers do not take packed examples"
    )
    monkeypatch.setattr(SequenceSplit, "gather_positions", lambda self, tensor: tensor)  # one process's whole batch
    packed = {
        "input_ids": torch.ones(1, 8, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
    }
    with pytest.raises(ContextParallelError) as step:
        SequenceSplit(None, 1, 0).plan(config, packed)
    assert str(step.value) == f"{reason}. Pad the batch instead."
    with pytest.raises(ContextParallelError) as check:
        check_context_parallel_model(config, 2, "--context_parallel_size", packed_by="--padding_free")
    assert str(check.value).startswith(f"--padding_free with --context_parallel_size 2: {reason}. Drop --padding_free")
    check_context_parallel_model(config, 2, "--context_parallel_size")  # padded batches split
    llama = tiny_family_config("llama", gaudi_model_class("llama").config_class)
    assert packed_batch_refusal(llama) is None
    check_context_parallel_model(llama, 2, "--context_parallel_size", packed_by="--padding_free")


def test_launches_that_cannot_split_are_refused():
    with pytest.raises(
        ContextParallelError,
        match="--context_parallel_size 2 splits each sequence over 2 processes, and this is one process",
    ):
        check_world_size(2, 1, "--context_parallel_size")
    with pytest.raises(ContextParallelError, match="--context_parallel_size 2 does not divide the 3 processes"):
        check_world_size(2, 3, "--context_parallel_size")
    check_world_size(2, 4)  # two replicas of two


def test_a_split_forward_needs_whole_sequence_positions_and_no_cache():
    model_class = gaudi_model_class("llama")
    model = model_class(tiny_family_config("llama", model_class.config_class))
    split = SequenceSplit(None, 1, 0)
    with pytest.raises(ContextParallelError, match="takes no cache. Pass use_cache=False"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long), context_parallel=split, use_cache=True)
    with pytest.raises(ContextParallelError, match="needs this process's position ids of the whole sequence"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long), context_parallel=split)


def test_explain_says_how_each_sequence_is_split_and_what_each_process_runs():
    model_class = gaudi_model_class("gpt_oss")
    config = tiny_family_config("gpt_oss", model_class.config_class, num_key_value_heads=1)
    text = explain_training(
        config,
        context_parallel_size=2,
        world_size=4,
        max_seq_length=101,
        use_flash_attention=True,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    lines = text.splitlines()
    assert lines[0] == "Processes: 4; context parallel size 2; 2 data-parallel replica(s)."
    assert lines[1].startswith("Sequences: up to 101 tokens, padded to a multiple of 2 (102); each process holds 51 ")
    layers = [line for line in lines if line.startswith(("layer ", "layers "))]
    assert len(layers) == 2  # the windowed layers and the full ones
    for line in layers:
        assert "per process 2 of 4 query heads and 1 of 1 key/value heads, each key/value head repeated x2" in line
        assert "over 102 positions; attention: " in line and "the sinks as one more key" in line


def test_explain_says_soft_capped_layers_train_on_the_default_path():
    """As the attention decides it: no fused kernel computes Gemma 2's soft-capped logits (it named the kernel)."""
    model_class = gaudi_model_class("gemma2")
    config = tiny_family_config("gemma2", model_class.config_class)
    options = {"context_parallel_size": 1, "world_size": 1, "max_seq_length": 16, "device": torch.device("cpu")}
    text = explain_training(config, use_flash_attention=True, dtype=torch.float32, **options)
    layers = [line for line in text.splitlines() if line.startswith(("layer ", "layers "))]
    assert layers and all(
        "attention: the default matmul-softmax attention (soft-capped logits" in line for line in layers
    )


@pytest.mark.parametrize("skip", [0, 1, 2, 3, 5])
def test_a_resumed_epoch_leaves_out_exactly_the_trained_batches(monkeypatch, skip):
    """Each round gathers the group's batches (here: this process's and its partner's), trained in turn; a resumed
    epoch starts at the first untrained one, in that order."""
    loader = [{"input_ids": torch.full((1, 4), round_)} for round_ in range(3)]

    def gather(out, own, group=None):
        # the partner's batch of the same round; past the last round neither has one
        out[:] = [own, None if own is None else {"input_ids": own["input_ids"] + 100}]

    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    batches = SplitBatches(loader, SequenceSplit(None, 2, 0))
    every = [int(batch["input_ids"][0, 0]) for batch in batches]
    assert every == [0, 100, 1, 101, 2, 102] and len(batches) == 6
    batches.skip = skip
    assert [int(batch["input_ids"][0, 0]) for batch in batches] == every[skip:]
    assert [int(batch["input_ids"][0, 0]) for batch in batches] == every  # the next epoch is whole


@pytest.mark.parametrize("skip", [0, 2, 4])
def test_the_last_round_leaves_out_the_turn_of_a_process_without_a_batch(monkeypatch, skip):
    """5 batches over 2 processes: the partner's shard holds 2, this one 3 (accelerate without even batches). The
    last round trains this process's batch alone, and the epoch ends when neither has one: 5 turns, not 6."""
    loader = [{"input_ids": torch.full((1, 4), round_)} for round_ in range(3)]
    partner = {0: 100, 1: 101}

    def gather(out, own, group=None):
        index = None if own is None else int(own["input_ids"][0, 0])
        theirs = {"input_ids": torch.full((1, 4), partner[index])} if index in partner else None
        out[:] = [own, theirs]

    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    batches = SplitBatches(loader, SequenceSplit(None, 2, 0), length=5)
    every = [int(batch["input_ids"][0, 0]) for batch in batches]
    assert every == [0, 100, 1, 101, 2] and len(batches) == 5
    batches.skip = skip
    assert [int(batch["input_ids"][0, 0]) for batch in batches] == every[skip:]


def test_every_process_must_have_the_fused_kernel_with_the_flag(monkeypatch):
    from optimum.habana import hpu
    from optimum.habana.transformers.context_parallel import trainer

    check_fused_kernel_everywhere(2, torch.device("cpu"))  # PyTorch's kernels are always there
    monkeypatch.setattr(hpu, "hpu_kernel", lambda: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(trainer, "gather_from_ranks", lambda problem: [None, problem])  # rank 0 has it, rank 1 not
    with pytest.raises(ContextParallelError) as error:
        check_fused_kernel_everywhere(2, torch.device("hpu"))
    assert str(error.value) == (
        "use_flash_attention with context parallel size 2: process 1 cannot import the Gaudi software's FusedSDPA. "
        "Install the Gaudi software on every node, or train without use_flash_attention."
    )


def test_deepspeeds_own_ulysses_wrapper_is_refused_before_it_trains_on_wrong_results(monkeypatch):
    """accelerate's sp_backend="deepspeed" wraps the 'sdpa' attention, which a Gaudi model's layers never call."""
    state = types.ModuleType(DEEPSPEED_SEQUENCE_PARALLEL_STATE)
    state._SEQUENCE_PARALLEL_GROUP = object()  # what DeepSpeed's initialize_sequence_parallel sets
    monkeypatch.setitem(sys.modules, DEEPSPEED_SEQUENCE_PARALLEL_STATE, state)
    model_class = gaudi_model_class("llama")
    model = model_class(tiny_family_config("llama", model_class.config_class))
    with pytest.raises(ContextParallelError, match="its wrapper of the 'sdpa' attention is never called"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long))
    state._SEQUENCE_PARALLEL_GROUP = None  # released: the model runs
    assert model(input_ids=torch.ones(1, 4, dtype=torch.long)).logits.shape == (1, 4, 256)


def test_the_trainer_refuses_a_flattening_collator_for_a_family_without_packed_examples(tmp_path, monkeypatch):
    """Llama 4's chunked layers take no packed examples: refused when the Trainer is built, not at its first step."""
    from transformers import DataCollatorWithFlattening, TrainingArguments

    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))  # one of two processes
    arguments = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    llama4 = gaudi_model_class("llama4_text")
    model = llama4(tiny_family_config("llama4_text", llama4.config_class))
    with pytest.raises(
        ContextParallelError,
        match="DataCollatorWithFlattening with context_parallel_size 2: a "
        "padding-free packed batch of the model type 'llama4_text': its chunked layers do not",
    ):
        ContextParallelTrainer(
            model=model, args=arguments, data_collator=DataCollatorWithFlattening(), context_parallel_size=2
        )


def test_the_trainer_takes_the_size_from_accelerates_parallelism_config(tmp_path):
    from accelerate import ParallelismConfig
    from transformers import TrainingArguments

    model_class = gaudi_model_class("llama")
    model = model_class(tiny_family_config("llama", model_class.config_class))
    config = ParallelismConfig(sp_backend="deepspeed", sp_size=2)
    arguments = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], parallelism_config=config)
    with pytest.raises(ContextParallelError, match="context_parallel_size 2 splits each sequence over 2 processes"):
        ContextParallelTrainer(model=model, args=arguments)  # read, then refused: this is one process
    assert arguments.parallelism_config is config  # the caller's arguments are left as they were
    with pytest.raises(ContextParallelError, match="sequence parallelism over 2 processes and context_parallel_size"):
        ContextParallelTrainer(model=model, args=arguments, context_parallel_size=4)
