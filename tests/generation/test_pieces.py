"""run_generation.py's pieces on their own: prompts, padding, sequence lengths, stats and the timed runs."""

import io
import sys
import time

import pytest
import torch
from transformers import BatchEncoding, PreTrainedTokenizerFast

from optimum.habana.cli.generation.prompts import (
    DEFAULT_PROMPTS,
    check_sequence_length,
    prompt_pool,
    prompts_for_batch,
    tokenize_prompts,
)
from optimum.habana.cli.generation.timing import RunMeasurement, benchmark, summarize_runs
from tests.generation.support import PROMPTS_OF_THREE_LENGTHS, parse


# ---------------------------------------------------------------------------------------------------------------
# Helpers


def test_prompts_are_cycled_to_fill_the_batch():
    assert prompts_for_batch(["a", "b"], 5) == ["a", "b", "a", "b", "a"]
    assert prompts_for_batch(prompt_pool(parse([]).workload), 2) == list(DEFAULT_PROMPTS[:2])


def test_prompt_flag_repeats_and_takes_several_values():
    arguments = parse(["--prompt", "a", "--prompt", "b", "c"])
    assert arguments.workload.prompt == ["a", "b", "c"]
    assert parse([]).workload.prompt is None


def test_boolean_flags_with_and_without_values():
    assert parse([]).workload.bf16 is None
    assert parse(["--bf16"]).workload.bf16 is True
    assert parse(["--bf16", "False"]).workload.bf16 is False
    explicit = parse(["--use_flash_attention", "True", "--flash_attention_fast_softmax", "True"]).attention
    assert explicit.use_flash_attention is True and explicit.flash_attention_fast_softmax is True


def test_prompts_are_left_padded_and_truncated_from_the_left(tiny_checkpoint):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_checkpoint)
    long_prompt = PROMPTS_OF_THREE_LENGTHS[1]
    full = tokenizer(long_prompt)["input_ids"]
    inputs, lengths = tokenize_prompts(tokenizer, ["Hello", long_prompt], max_input_tokens=8, chat=False)
    assert inputs["input_ids"].shape == (2, 8)
    assert lengths == [len(tokenizer("Hello")["input_ids"]), len(full)]
    assert inputs["attention_mask"][0].tolist()[-1] == 1 and inputs["attention_mask"][0].tolist()[0] == 0
    assert inputs["input_ids"][1].tolist() == full[-8:]  # the end of the prompt is what the model continues

    unpadded, _ = tokenize_prompts(tokenizer, ["Hello", long_prompt], max_input_tokens=0, chat=False)
    assert unpadded["input_ids"].shape == (2, len(full))


def test_stats_are_medians_of_the_measured_runs():
    runs = [RunMeasurement(2.0, 0.2, 10), RunMeasurement(1.0, 0.1, 10), RunMeasurement(4.0, 0.4, 10)]
    stats = summarize_runs(runs, batch_size=3)
    assert stats["throughput_tokens_per_second"] == pytest.approx(15.0)  # 3 x 10 / 2.0 s
    assert stats["first_token_latency_seconds"] == pytest.approx(0.2)
    assert stats["generation_seconds"] == pytest.approx(2.0)
    assert stats["new_tokens"] == 10 and len(stats["runs"]) == 3


def test_sequence_length_check():
    check_sequence_length(100, 28, 128, fixed=True)
    with pytest.raises(ValueError, match=r"--max_input_tokens \(100\) \+ --max_new_tokens \(29\) = 129"):
        check_sequence_length(100, 29, 128, fixed=True)
    check_sequence_length(10_000, 10, None, fixed=False)  # no limit known: nothing to check


class StubModel:
    """generate() that takes 30 ms, its first token ready after 10 ms, and adds 3 tokens."""

    def generate(self, input_ids, attention_mask, generation_config, logits_processor):
        time.sleep(0.01)
        logits_processor(input_ids, torch.zeros(input_ids.shape[0], 8))
        time.sleep(0.02)
        return torch.cat([input_ids, torch.zeros(input_ids.shape[0], 3, dtype=torch.long)], dim=1)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_benchmark_times_the_measured_runs_and_shows_progress_on_a_terminal(monkeypatch):
    inputs = BatchEncoding({"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5)})
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    result = benchmark(StubModel(), inputs, None, device=torch.device("cpu"), seed=0, warmup=1, n_iterations=2)
    assert len(result.runs) == 2 and result.output.shape == (2, 8)
    for run in result.runs:
        assert run.new_tokens == 3
        assert 0.01 <= run.first_token_seconds < run.seconds
        assert run.seconds >= 0.03
    assert result.warmup_seconds >= 0.03
    assert "generate" in terminal.getvalue() and "3/3" in terminal.getvalue()

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no progress bar
    benchmark(StubModel(), inputs, None, device=torch.device("cpu"), seed=0, warmup=0, n_iterations=1)
    assert sys.stderr.getvalue() == ""
