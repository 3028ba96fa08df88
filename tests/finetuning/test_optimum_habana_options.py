"""Optimum-Habana's fine-tuning options in run_lora_clm.py: each acts, or prints one line of what it does here."""

import copy
import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import EvalPrediction, Qwen3MoeForCausalLM, TrainerCallback, TrainingArguments

from optimum.habana.cli.finetuning import data as finetuning_data
from optimum.habana.cli.finetuning import gaudi_arguments as gaudi_training_arguments
from optimum.habana.cli.finetuning import prompts
from optimum.habana.cli.finetuning.gaudi_arguments import GaudiTrainingArguments, apply_gaudi_training_arguments
from optimum.habana.cli.finetuning.trainer import next_token_accuracy
from tests.families.tiny_configs import tiny_family_config
from tests.finetuning.support import run_script, script_args


STEPS = "--do_train --max_steps 3 --per_device_train_batch_size 4 --logging_steps 1 --validation_split_percentage 0"
CPU = torch.device("cpu")


def run(script, checkpoint, tmp_path, *extra):
    return run_script(script, script_args(checkpoint, tmp_path, *STEPS.split(), *extra))


@pytest.mark.parametrize(
    ("implementation", "path"), [("eager", "default"), ("sdpa", "fused"), ("gaudi_fused_sdpa", "fused")]
)
def test_attn_implementation_selects_the_path(script, checkpoint, tmp_path, implementation, path):
    result = run(script, checkpoint, tmp_path, "--attn_implementation", implementation)
    assert result.counts[path] > 0
    assert result.counts["default" if path == "fused" else "fused"] == 0


def test_attn_implementation_with_its_companion_flags_runs_fused(script, checkpoint, tmp_path):
    argv = ["--attn_implementation", "gaudi_fused_sdpa", "--flash_attention_causal_mask", "True"]
    argv += ["--flash_attention_recompute", "True"]
    result = run(script, checkpoint, tmp_path, *argv)
    assert result.counts["fused"] > 0 and result.counts["default"] == 0
    assert result.recompute and all(result.recompute)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["--attn_implementation", "eager", "--use_flash_attention"],
            "--attn_implementation eager and --use_flash_attention True contradict each other",
        ),
        (
            ["--attn_implementation", "sdpa", "--use_flash_attention", "False"],
            "--attn_implementation sdpa and --use_flash_attention False contradict each other",
        ),
        (
            ["--attn_implementation", "eager", "--use-flash-attention=True"],
            "--attn_implementation eager and --use_flash_attention True contradict each other",
        ),
        (["--context_parallel_size", "0"], "--context_parallel_size must be at least 1, got 0."),
        (["--peft_type", "ia3", "--lora_rank", "4"], "--peft_type ia3 does not use --lora_rank (lora)"),
        (["--peft_type", "bitfit"], "invalid choice: 'bitfit'"),
        (["--throughput_warmup_steps", "-1"], "--throughput_warmup_steps must be 0 or more"),
        (["--warmup_ratio", "1.5"], "--warmup_ratio must be in [0, 1), got 1.5"),
        (["--attn_implementation", "flash_attention_2"], "invalid choice: 'flash_attention_2'"),
        (["--instruction_column_name", "nope"], "--instruction_column_name 'nope': --train_file"),
        (["--pad_to_max_length", "--padding_free"], "--pad_to_max_length and --padding_free contradict each other"),
        (["--max_train_samples", "0"], "--max_train_samples must be at least 1, got 0."),
    ],
)
def test_bad_values_are_usage_errors(script, checkpoint, tmp_path, capsys, argv, words):
    with pytest.raises(SystemExit) as exit_info:
        script.main(script_args(checkpoint, tmp_path, *STEPS.split(), *argv))
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and words in stderr and "Traceback" not in stderr


def test_gaudi_only_options_say_what_they_do_here(script, checkpoint, tmp_path, caplog):
    argv = ["--use_habana", "--use_lazy_mode", "--use_hpu_graphs_for_training"]  # bare --use_lazy_mode: True
    argv += ["--use_hpu_graphs_for_inference", "--gaudi_config_name", "Habana/llama", "--pipelining_fwd_bwd"]
    argv += ["--use_fused_rope", "False", "--fp8", "--use_regional_compilation", "--compile_from_sec_iteration"]
    run(script, checkpoint, tmp_path, *argv)
    for words in (
        "--use_habana: no Gaudi device here; training runs on cpu.",
        "--use_lazy_mode: Gaudi's execution mode is chosen by the PT_HPU_LAZY_MODE",
        "--use_hpu_graphs_for_training: this script does not capture HPU graphs",
        "--use_hpu_graphs_for_inference: this script does not capture HPU graphs",
        "--gaudi_config_name Habana/llama: Gaudi configs choose Habana's fused optimizer",
        "--pipelining_fwd_bwd: a Gaudi lazy-mode scheduling option; no effect here.",
        "--use_fused_rope: transformers' rotary embedding runs here",
        "--fp8: fp8 training is not supported by this script; training runs in torch.float32.",
        "--use_regional_compilation and --compile_from_sec_iteration: nothing is compiled without --torch_compile.",
    ):
        assert caplog.text.count(words) == 1, words


def test_warmup_ratio_becomes_transformers_5_warmup_steps(tmp_path):
    training_args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    apply_gaudi_training_arguments(GaudiTrainingArguments(warmup_ratio=0.25), training_args, CPU, torch.float32)
    assert training_args.warmup_steps == 0.25 and training_args.get_warmup_steps(40) == 10
    both = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", warmup_steps=3)
    with pytest.raises(ValueError, match="--warmup_ratio and --warmup_steps both set the warm-up"):
        apply_gaudi_training_arguments(GaudiTrainingArguments(warmup_ratio=0.25), both, CPU, torch.float32)


def test_train_on_inputs_puts_the_prompt_in_the_loss(script, tokenizer):
    dataset = finetuning_data.load_raw_datasets(
        train_file=str(script.DEFAULT_TRAIN_FILE),
        validation_file=None,
        dataset_name=None,
        dataset_config_name=None,
        validation_split_percentage=0,
        seed=0,
    )
    raw, data_format = dataset
    rows = raw["train"].select(range(3))
    if tokenizer.eos_token is None:
        tokenizer.eos_token = tokenizer.pad_token
    masked = finetuning_data.tokenize_dataset(rows, tokenizer, data_format, 64)
    trained = finetuning_data.tokenize_dataset(rows, tokenizer, data_format, 64, train_on_inputs=True)
    for off, on in zip(masked, trained, strict=True):
        assert off["input_ids"] == on["input_ids"]
        assert on["labels"] == on["input_ids"]
        assert finetuning_data.IGNORE_INDEX in off["labels"]


class SlowFirstStep(TrainerCallback):
    """The first step (a warm-up step) takes a second longer, like a compilation; each step's end is recorded."""

    def __init__(self) -> None:
        self.step_ends: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            time.sleep(1.0)

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(time.perf_counter())


def test_throughput_warmup_steps_leave_the_first_steps_out(script, checkpoint, tmp_path):
    """Steps 2 and 3 (8 samples) over their own time, as the steps' ends measure it (timed against the run's own
    steps, not a fixed speed: a loaded machine slows every step)."""
    argv = script_args(checkpoint, tmp_path, *STEPS.split(), "--throughput_warmup_steps", "1")
    slow_first = SlowFirstStep()
    metrics = script.main(argv, callbacks=[slow_first])
    first_end, _, last_end = slow_first.step_ends
    assert metrics["train_samples_per_second"] == pytest.approx(2 * 4 / (last_end - first_end), rel=0.05)
    all_steps = 3 * 4 / metrics["train_runtime"]  # what the Trainer reports: the slow step included
    assert metrics["train_samples_per_second"] > all_steps
    saved = json.loads((tmp_path / "train_results.json").read_text())
    assert saved["train_samples_per_second"] == pytest.approx(metrics["train_samples_per_second"])


def test_throughput_warmup_longer_than_training_says_so(script, checkpoint, tmp_path, caplog):
    metrics = script.main(script_args(checkpoint, tmp_path, *STEPS.split(), "--throughput_warmup_steps", "5"))
    assert "--throughput_warmup_steps 5: training ended within the warm-up steps" in caplog.text
    assert metrics["train_samples_per_second"] > 0


UPSTREAM_LLAMA3_8B_COMMAND = """--bf16 False --num_train_epochs 1 --max_steps 2 --per_device_train_batch_size 1
    --gradient_accumulation_steps 2 --eval_strategy no --save_strategy no --learning_rate 3e-4 --warmup_ratio 0.03
    --lr_scheduler_type constant --max_grad_norm 1.0 --logging_steps 1 --do_train --do_eval --use_habana
    --use_lazy_mode False --throughput_warmup_steps 1 --lora_rank=8 --lora_alpha=16 --lora_dropout=0.05
    --lora_target_modules q_proj v_proj --dataset_concatenation --max_seq_len 64 --adam_epsilon 1e-08
    --validation_split_percentage 4 --fp8 --attn_implementation gaudi_fused_sdpa --flash_attention_causal_mask True
    --per_device_eval_batch_size 4 --cache_size_limit 64 --use_regional_compilation --compile_from_sec_iteration
    --allow_unspec_int_on_nn_module True"""


def test_an_upstream_command_line_runs(script, checkpoint, tmp_path, caplog):
    """Optimum-Habana's Llama3.1-8B LoRA flash-attention command (README), with the launcher, DeepSpeed and the
    HPU compile backend removed, the model swapped for the tiny one, and the steps and lengths shrunk."""
    argv = UPSTREAM_LLAMA3_8B_COMMAND.split()
    before = (torch._dynamo.config.cache_size_limit, torch._dynamo.config.allow_unspec_int_on_nn_module)
    try:
        result = run_script(script, script_args(checkpoint, tmp_path, *argv))
        assert torch._dynamo.config.cache_size_limit == 64
        assert torch._dynamo.config.allow_unspec_int_on_nn_module is True
    finally:
        torch._dynamo.config.cache_size_limit, torch._dynamo.config.allow_unspec_int_on_nn_module = before
    assert result.counts["fused"] > 0 and result.counts["default"] == 0
    assert result.metrics["eval_loss"] > 0 and "perplexity" in result.metrics
    assert result.metrics["train_samples"] > 0  # packed into --max_seq_len blocks of 64 tokens
    assert "--fp8: fp8 training is not supported" in caplog.text


def test_next_token_accuracy_scores_labelled_positions_only():
    # Position t predicts label t + 1; -100 labels (prompt, padding, example starts) are not scored.
    predictions = np.array([[5, 6, 7, 8], [1, 2, -100, -100]])
    labels = np.array([[-100, 5, 0, 8], [-100, 1, -100, -100]])
    # Scored: 5->5 (right), 6->0, 7->8 (wrong), and 1->1 (right) in the second row: 2 of 4.
    assert next_token_accuracy(EvalPrediction(predictions, labels)) == {"accuracy": 0.5}


def test_an_moe_model_evaluates_with_its_router_loss_on(script, tokenizer, tmp_path):
    """With its router loss on, an MoE model hands the Trainer a tuple of outputs (it crashed the accuracy's
    argmax): the logits are found in it, and the accuracy is that of the same weights with the router loss off."""
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(tiny_family_config("qwen3_moe", vocab_size=len(tokenizer))).save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    evaluation = ["--do_eval", "--validation_split_percentage", "20", "--per_device_eval_batch_size", "4"]
    accuracy = {}
    for router_loss in (False, True):
        config = json.loads((tmp_path / "moe" / "config.json").read_text())
        (tmp_path / "moe" / "config.json").write_text(json.dumps({**config, "output_router_logits": router_loss}))
        metrics = script.main(script_args(tmp_path / "moe", tmp_path / f"run-{router_loss}", *evaluation))
        accuracy[router_loss] = metrics["eval_accuracy"]
    assert accuracy[True] == accuracy[False] and 0 <= accuracy[True] <= 1


def test_logs_and_results_carry_upstreams_metrics(script, checkpoint, tmp_path):
    argv = script_args(checkpoint, tmp_path, *STEPS.split(), "--do_eval", "--validation_split_percentage", "10")
    metrics = script.main(argv)
    assert 0 <= metrics["eval_accuracy"] <= 1 and metrics["perplexity"] > 1
    assert json.loads((tmp_path / "train_results.json").read_text())["epoch"] > 0  # the Trainer's own entries stay
    for name in ("eval_results.json", "all_results.json"):
        assert json.loads((tmp_path / name).read_text())["eval_accuracy"] == pytest.approx(metrics["eval_accuracy"])
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    training_logs = [entry for entry in state["log_history"] if "loss" in entry]
    assert len(training_logs) == 3
    for entry in training_logs:
        assert (
            entry["memory_allocated (GB)"] > 0 and entry["max_memory_allocated (GB)"] >= entry["memory_allocated (GB)"]
        )
        assert entry["total_memory_available (GB)"] > entry["max_memory_allocated (GB)"]


def test_data_options_act(script, checkpoint, tmp_path, caplog):
    rows = [{"question": f"Name color {i}.", "context": "", "answer": "red"} for i in range(12)]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["--train_file", str(data), "--instruction_column_name", "question", "--input_column_name", "context"]
    argv += ["--output_column_name", "answer", "--max_train_samples", "5", "--do_eval"]
    argv += ["--validation_split_percentage", "25", "--max_eval_samples", "2", "--pad_to_max_length"]
    argv += ["--max_seq_length", "32", "--save_last_ckpt", "False", "--low_cpu_mem_usage", "True"]
    out = tmp_path / "out"
    metrics = script.main(script_args(checkpoint, out, *STEPS.split(), *argv))
    assert metrics["train_samples"] == 5 and metrics["eval_samples"] == 2
    assert not (out / "adapter_model.safetensors").exists() and (out / "train_results.json").is_file()
    assert "--save_last_ckpt False: the final adapter is not saved" in caplog.text
    assert "--low_cpu_mem_usage: transformers 5 always loads weights this way" in caplog.text


def test_pad_to_max_length_gives_fixed_shapes(tokenizer):
    features = [{"input_ids": [5] * n, "attention_mask": [1] * n, "labels": [5] * n} for n in (3, 7)]
    batch = finetuning_data.data_collator(tokenizer, padding_free=False, pad_to=16)(features)
    assert batch["input_ids"].shape == (2, 16) and (batch["labels"][:, 7:] == finetuning_data.IGNORE_INDEX).all()


def test_keep_linebreaks_keeps_each_lines_newline(tmp_path):
    text = tmp_path / "lines.txt"
    text.write_text("flash attention\nsaves memory\n")
    kept = finetuning_data.load_data_file(str(text), "--train_file", keep_linebreaks=True)
    plain = finetuning_data.load_data_file(str(text), "--train_file")
    assert kept[finetuning_data.TEXT_FIELD] == ["flash attention\n", "saves memory\n"]
    assert plain[finetuning_data.TEXT_FIELD] == ["flash attention", "saves memory"]


def test_peft_type_trains_and_saves_its_adapter(script, checkpoint, tmp_path):
    result = run(script, checkpoint, tmp_path, "--peft_type", "ia3", "--use_flash_attention")
    assert result.counts["fused"] > 0 and result.counts["default"] == 0
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == "IA3" and set(saved["target_modules"]) == {"k_proj", "v_proj", "down_proj"}
    assert saved["feedforward_modules"] == ["down_proj"]
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    recorded = state["stateful_callbacks"]["RunArguments"]["args"]
    assert recorded["peft_type"] == "ia3"  # a resume with another --peft_type is refused


def test_adalora_prunes_its_ranks_in_the_script(script, checkpoint, tmp_path):
    argv = ["--peft_type", "adalora", "--adalora_init_r", "4", "--adalora_target_r", "1", "--adalora_tinit", "1"]
    argv += ["--adalora_tfinal", "1", "--adalora_delta_t", "1", "--max_steps", "4"]
    run(script, checkpoint, tmp_path, *argv)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == "ADALORA" and saved["total_step"] == 4
    assert saved["rank_pattern"] and sum(sum(mask) for mask in saved["rank_pattern"].values()) < 4 * len(
        saved["rank_pattern"]
    )


def test_adalora_schedule_beyond_the_run_is_a_usage_error(script, checkpoint, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(script_args(checkpoint, tmp_path, *STEPS.split(), "--peft_type", "adalora"))
    assert exit_info.value.code == 2
    assert "--adalora_tinit 50 and --adalora_tfinal 100 leave no step to prune the ranks in this run's 3 steps" in (
        capsys.readouterr().err
    )


def test_chat_prompt_puts_the_instruction_in_the_chat_template(script, tokenizer):
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s>{% endfor %}" + (
        "{% if add_generation_prompt %}<s> assistant :{% endif %}"
    )
    raw, data_format = finetuning_data.load_raw_datasets(
        train_file=str(script.DEFAULT_TRAIN_FILE),
        validation_file=None,
        dataset_name=None,
        dataset_config_name=None,
        validation_split_percentage=0,
        seed=0,
    )
    row = raw["train"][0]
    tokenized = finetuning_data.tokenize_dataset(
        raw["train"].select([0]), chat, data_format, 256, prompt_style="chat"
    )[0]
    prompt = prompts.build_chat_prompt(chat, row["instruction"], row["input"])
    assert prompt.startswith("<s> user : " + row["instruction"].split()[0]) and prompt.endswith("<s> assistant :")
    prompt_ids = chat(prompt, add_special_tokens=False)["input_ids"]
    assert tokenized["input_ids"][: len(prompt_ids)] == prompt_ids  # the template's own specials, nothing added
    assert tokenized["labels"][: len(prompt_ids)] == [finetuning_data.IGNORE_INDEX] * len(prompt_ids)
    assert tokenized["labels"][len(prompt_ids)] != finetuning_data.IGNORE_INDEX  # the response is learned
    with pytest.raises(
        finetuning_data.FineTuningError, match="--chat_prompt: the model's tokenizer has no chat template"
    ):
        finetuning_data.tokenize_dataset(raw["train"].select([0]), tokenizer, data_format, 256, prompt_style="chat")
    with pytest.raises(finetuning_data.FineTuningError, match="--chat_prompt formats instruction data"):
        prompts.check_prompt_style("chat", chat, "text")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("adjust", "expected"), [(False, 4 * 2 / 13.0), (True, 4 * 2 / 8.0)])
def test_adjust_throughput_leaves_logging_evaluation_and_saving_out(monkeypatch, adjust, expected):
    """Warm-up 1 step, then 4 steps of 2 s each; after step 3 a log (1 s), an evaluation (3 s) and a save (1 s)."""
    clock = FakeClock()
    monkeypatch.setattr(gaudi_training_arguments.time, "perf_counter", clock)
    throughput = gaudi_training_arguments.ThroughputAfterWarmup(1, adjust=adjust)
    state = SimpleNamespace(global_step=0)
    throughput.on_train_begin(None, state, None)
    for step in range(1, 6):
        clock.now += 2.0 if step > 1 else 10.0
        state.global_step = step
        throughput.on_step_end(None, state, None)
        if step == 3:
            for event, seconds in (("on_log", 1.0), ("on_evaluate", 3.0), ("on_save", 1.0)):
                clock.now += seconds
                getattr(throughput, event)(None, state, None)
    clock.now += 7.0  # after training: the final log and saving the adapter, never counted
    assert throughput.samples_per_second(2) == pytest.approx(expected)
