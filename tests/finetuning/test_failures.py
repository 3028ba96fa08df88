"""Bad input and faults for examples/language-modeling/run_lora_clm.py: each refused with its exit status and a
one-line message that says what is wrong, nothing of an earlier run lost, and a killed run resumable.

The table cases run `main(argv)` in-process (SystemExit carries the status); subprocesses only where a real signal
is the point. Everything runs on the tiny Llama and word-level tokenizer of tests/test_run_lora_clm.py.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, LlamaForCausalLM, TrainerCallback, TrainingArguments

from optimum.habana.cli.finetuning import data as finetuning_data
from optimum.habana.cli.finetuning.arguments import ARGUMENT_CLASSES, check_arguments, parse_arguments
from optimum.habana.utils import devices
from optimum.habana.utils.atomic import current_umask
from optimum.habana.utils.model_loading import CACHE_ENV_VAR
from tests.families.tiny_configs import tiny_family_config
from tests.finetuning.support import SCRIPT, build_tokenizer, save_word_level_checkpoint, script_args
from tests.helpers import ROOT, load_script, write_gguf


DRIVER = ROOT / "tests" / "fault_driver.py"
PROG = "run_lora_clm.py: "
TRAIN = (
    "--do_train --max_steps 2 --per_device_train_batch_size 4 --validation_split_percentage 0 --max_seq_length 64 "
    "--lora_dropout 0 --logging_steps 1"
)
SAVE_EVERY_STEP = ["--save_strategy", "steps", "--save_steps", "1"]
ADAPTER = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def script():
    return load_script("examples/language-modeling/run_lora_clm.py")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_word_level_checkpoint(tmp_path_factory.mktemp("tiny_llama"), build_tokenizer())


@pytest.fixture(scope="module")
def earlier_run(script, checkpoint, tmp_path_factory) -> Path:
    """A finished run: checkpoint-1, checkpoint-2, and the adapter with its results at the top."""
    output_dir = tmp_path_factory.mktemp("earlier")
    script.main(script_args(checkpoint, output_dir, *TRAIN.split(), *SAVE_EVERY_STEP))
    return output_dir


@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory) -> Path:
    """The tiny Llama with one nan weight: its loss is nan from the first step."""
    tokenizer = build_tokenizer()
    folder = save_word_level_checkpoint(tmp_path_factory.mktemp("nan_llama"), tokenizer)
    model = LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    model.save_pretrained(folder)
    return folder


@dataclass
class Context:
    """What a case may build its command line from."""

    tmp: Path
    checkpoint: Path
    earlier: Path
    nan_checkpoint: Path
    out: Path = field(init=False)

    def __post_init__(self) -> None:
        self.out = self.tmp / "out"

    def args(self, *extra: str, model: Path | None = None) -> list[str]:
        return script_args(model or self.checkpoint, self.out, *TRAIN.split(), *extra)

    def family_checkpoint(self, model_type: str) -> Path:
        """A tiny stock checkpoint of `model_type`, with the word-level tokenizer beside it."""
        tokenizer = build_tokenizer()
        torch.manual_seed(0)
        config = tiny_family_config(model_type, vocab_size=len(tokenizer))
        AutoModelForCausalLM.from_config(config).save_pretrained(self.tmp / model_type)
        tokenizer.save_pretrained(self.tmp / model_type)
        return self.tmp / model_type

    def file(self, name: str, content: str | bytes) -> str:
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def copied_checkpoint(self, damage: Callable[[Path], None] = lambda path: None) -> str:
        copy = self.tmp / "resume-from" / "checkpoint-2"
        shutil.copytree(self.earlier / "checkpoint-2", copy)
        damage(copy)
        return str(copy)


class RaiseAt(TrainerCallback):
    """Raises `error` when training step `step` begins, optionally leaving a half-written checkpoint first."""

    def __init__(self, error: BaseException, step: int = 1, partial_checkpoint: bool = False) -> None:
        self.error, self.step, self.partial_checkpoint = error, step, partial_checkpoint

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            if self.partial_checkpoint:  # what a run stopped while saving checkpoint-N leaves
                partial = Path(args.output_dir) / f"checkpoint-{self.step}"
                partial.mkdir()
                (partial / ADAPTER).write_bytes(b"half")
            raise self.error


@dataclass
class Case:
    argv: Callable[[Context], list[str]]
    status: int
    words: list[str]
    before_load: bool = True  # refused before the model is loaded
    callbacks: Callable[[], list[TrainerCallback]] = list


JSONL_ROW = '{"instruction": "Name a color.", "input": "", "output": "red"}\n'
LATIN_1_ROW = '{"instruction": "Café?", "output": "Yes."}\n'.encode("latin-1")

CASES = {
    # nothing lost: output folder
    "non-empty output_dir": Case(
        lambda c: (c.out.mkdir(), (c.out / ADAPTER).write_text("earlier"), c.args())[-1],
        2,
        ["not empty", ADAPTER, "--overwrite_output_dir", "--resume_from_checkpoint"],
    ),
    "resume a checkpoint saved elsewhere into a finished run's output_dir": Case(
        lambda c: (
            c.out.mkdir(),
            (c.out / ADAPTER).write_text("earlier"),
            c.args("--resume_from_checkpoint", c.copied_checkpoint()),
        )[-1],
        2,
        ["not empty", ADAPTER, "refusing to overwrite an earlier run", "--overwrite_output_dir"],
    ),
    "--padding_free with a state-space family": Case(
        lambda c: c.args("--padding_free", model=c.family_checkpoint("bamba")),
        2,
        ["--padding_free", "'bamba' has linear_attention layers, whose state runs along the", "Drop --padding_free"],
    ),
    "output_dir is a file": Case(lambda c: c.args("--output_dir", c.file("taken", "x")), 2, ["is a file"]),
    "output_dir not writable": Case(
        lambda c: c.args("--output_dir", c.file("taken", "x") + "/sub"), 2, ["cannot be written"]
    ),
    # non-finite numbers and seeds, refused before anything loads
    "--lora_alpha nan": Case(lambda c: c.args("--lora_alpha", "nan"), 2, ["--lora_alpha", "finite", "nan"]),
    "--learning_rate inf": Case(lambda c: c.args("--learning_rate", "inf"), 2, ["--learning_rate", "inf"]),
    "--weight_decay -inf": Case(lambda c: c.args("--weight_decay=-inf"), 2, ["--weight_decay", "-inf"]),
    "--seed -1": Case(lambda c: c.args("--seed", "-1"), 2, ["--seed", "-1", "4294967295"]),
    "--data_seed 2**32": Case(lambda c: c.args("--data_seed", str(2**32)), 2, ["--data_seed", "4294967296"]),
    # nothing silent: step counts that train or save nothing
    "--max_steps 0": Case(lambda c: c.args("--max_steps", "0"), 2, ["--max_steps 0 trains no step", "-1"]),
    "--num_train_epochs 0": Case(
        lambda c: c.args("--max_steps", "-1", "--num_train_epochs", "0"),
        2,
        ["--num_train_epochs 0 trains no step", "--max_steps N"],
    ),
    "--save_steps 0": Case(
        lambda c: c.args("--save_strategy", "steps", "--save_steps", "0"),
        2,
        ["--save_steps 0 never saves a checkpoint", "--save_strategy no"],
    ),
    # values PyTorch refuses only once the model is loaded (evaluation's batch size after the whole training)
    "--learning_rate -1": Case(lambda c: c.args("--learning_rate", "-1"), 2, ["--learning_rate must be above 0"]),
    "--per_device_train_batch_size 0": Case(
        lambda c: c.args("--per_device_train_batch_size", "0"), 2, ["--per_device_train_batch_size", "at least 1"]
    ),
    "--per_device_eval_batch_size 0": Case(
        lambda c: c.args("--do_eval", "--per_device_eval_batch_size", "0"),
        2,
        ["--per_device_eval_batch_size must be at least 1, got 0."],
    ),
    "--gradient_accumulation_steps 0": Case(
        lambda c: c.args("--gradient_accumulation_steps", "0"), 2, ["--gradient_accumulation_steps", "at least 1"]
    ),
    "--adam_beta1 2": Case(lambda c: c.args("--adam_beta1", "2"), 2, ["--adam_beta1 must be in [0, 1), got 2."]),
    "--adam_epsilon -1": Case(lambda c: c.args("--adam_epsilon", "-1"), 2, ["--adam_epsilon must be 0 or more"]),
    "--dataloader_num_workers -1": Case(
        lambda c: c.args("--dataloader_num_workers", "-1"), 2, ["--dataloader_num_workers", "got -1"]
    ),
    # nothing silent: values that train nothing, an untrained adapter saved as the result
    "--gradient_accumulation_steps -1": Case(
        lambda c: c.args("--gradient_accumulation_steps", "-1"),
        2,
        ["--gradient_accumulation_steps must be at least 1, got -1."],
    ),
    "--learning_rate 0": Case(
        lambda c: c.args("--learning_rate", "0"), 2, ["--learning_rate must be above 0, got 0", "as it starts"]
    ),
    "--lora_alpha 0": Case(lambda c: c.args("--lora_alpha", "0"), 2, ["--lora_alpha 0", "never train"]),
    # nothing silent: data
    "row without an answer": Case(
        lambda c: c.args("--train_file", c.file("d.jsonl", JSONL_ROW * 2 + '{"instruction": "Why?"}\n')),
        2,
        ["d.jsonl", "line 3", "'output'", "missing or null"],
    ),
    "null answer after a blank line": Case(
        lambda c: c.args("--train_file", c.file("d.jsonl", JSONL_ROW + "\n" + JSONL_ROW.replace('"red"', "null"))),
        2,
        ["line 3", "'output'"],
    ),
    "csv row without an instruction": Case(
        lambda c: c.args("--train_file", c.file("d.csv", "instruction,input,output\nAdd.,1 2,3\n,,red\n")),
        2,
        ["d.csv", "line 3", "'instruction'"],
    ),
    "non-UTF-8 data file": Case(
        lambda c: c.args("--train_file", c.file("d.jsonl", JSONL_ROW.encode() + LATIN_1_ROW)),
        2,
        ["d.jsonl", "not UTF-8", "line 2", "\\xe9"],
    ),
    "NUL bytes in the data": Case(
        lambda c: c.args("--train_file", c.file("d.txt", b"flash attention\n" + bytes(4096))),
        2,
        ["d.txt", "is not text: line 2 holds a NUL byte at column 1"],
    ),
    "--max_seq_length beyond the model's positions": Case(
        lambda c: c.args("--max_seq_length", "4096"),
        2,
        ["--max_seq_length 4096 is beyond the model's 2048 positions", "--max_seq_length 2048 or less"],
    ),
    "--max_seq_length 1e9 with packing": Case(
        lambda c: c.args("--max_seq_length", str(10**9), "--dataset_concatenation"),
        2,
        [f"--max_seq_length {10**9} is beyond"],
    ),
    "gaudi_spawn.py's flags with --bf16": Case(
        lambda c: c.args("--bf16", "True", "--use_lazy_mode", "--world_size", "8", "--use_deepspeed"),
        2,
        ["unrecognized arguments: --world_size 8 --use_deepspeed"]
        + ([] if torch.cuda.is_available() else ["--use_deepspeed; Your setup doesn't support bf16"]),
    ),
    "every field of every row blank, padding-free": Case(
        lambda c: c.args(
            "--train_file",
            c.file("d.jsonl", '{"instruction": "", "input": "", "output": " "}\n' * 4),
            "--padding_free",
        ),
        2,
        ["d.jsonl", "has no examples: the instruction, input, output of every row are blank"],
    ),
    "every response blank": Case(
        lambda c: c.args("--train_file", c.file("d.jsonl", '{"instruction": "Name a color.", "output": ""}\n' * 4)),
        2,
        ["d.jsonl", "the 'output' column", "blank in every row", "--output_column_name", "instruction, output"],
    ),
    "every response blank in the column named by --output_column_name": Case(
        lambda c: c.args(
            "--train_file",
            c.file("d.csv", "question,answer,reply\nAdd 1 and 2., ,3\nName a color.,  ,red\n"),
            "--instruction_column_name",
            "question",
            "--output_column_name",
            "answer",
        ),
        2,
        ["d.csv", "the 'answer' column", "blank in every row", "(the columns: question, answer, reply)"],
    ),
    "--fsdp with an unknown option, one process": Case(
        lambda c: c.args("--fsdp", "bogus_value"),
        2,
        ["--fsdp 'bogus_value': 'bogus_value' is not an FSDP option", "full_shard", "auto_wrap"],
    ),
    "--padding_free with --dataset_concatenation": Case(
        lambda c: c.args("--padding_free", "--dataset_concatenation"),
        2,
        ["--padding_free and --dataset_concatenation both pack the examples", "Choose one"],
    ),
    "unknown LoRA target": Case(
        lambda c: c.args("--lora_target_modules", "q_proj", "v_prj"),
        2,
        ["--lora_target_modules", "'v_prj'", "k_proj", "o_proj", "down_proj"],
        before_load=False,
    ),
    # resuming
    "resume True without a checkpoint": Case(
        lambda c: c.args("--resume_from_checkpoint", "True"), 2, ["--resume_from_checkpoint True", "no complete"]
    ),
    "resume from a missing folder": Case(
        lambda c: c.args("--resume_from_checkpoint", str(c.tmp / "nowhere")), 2, ["nowhere", "not a folder"]
    ),
    "resume from an incomplete checkpoint": Case(
        lambda c: c.args(
            "--resume_from_checkpoint", c.copied_checkpoint(lambda path: (path / "trainer_state.json").unlink())
        ),
        2,
        ["checkpoint-2", "no trainer_state.json"],
    ),
    "resume with a junk adapter_config.json": Case(
        lambda c: c.args(
            "--resume_from_checkpoint",
            c.copied_checkpoint(lambda path: (path / "adapter_config.json").write_text('{"r": 8,')),
        ),
        2,
        ["adapter_config.json", "not valid JSON"],
    ),
    "resume from an adapter folder without weights": Case(
        lambda c: c.args("--resume_from_checkpoint", c.copied_checkpoint(lambda path: (path / ADAPTER).unlink())),
        2,
        ["checkpoint-2", "no weights", ADAPTER],
    ),
    "resume from truncated adapter weights": Case(
        lambda c: c.args(
            "--resume_from_checkpoint",
            c.copied_checkpoint(lambda path: os.truncate(path / ADAPTER, 100)),
        ),
        2,
        [ADAPTER, "damaged or truncated"],
    ),
    "overwrite and resume True": Case(
        lambda c: c.args("--overwrite_output_dir", "--resume_from_checkpoint", "True"),
        2,
        ["--overwrite_output_dir and --resume_from_checkpoint True contradict", "Choose one"],
    ),
    "resume another run's checkpoint": Case(
        lambda c: c.args("--resume_from_checkpoint", c.copied_checkpoint(), "--learning_rate", "5e-4", "--seed", "7"),
        2,
        ["checkpoint-2", "other arguments", "--learning_rate 5e-05 there, 0.0005 here", "--seed 0 there, 7 here"],
    ),
    "resume with a smaller --max_steps": Case(
        lambda c: c.args("--resume_from_checkpoint", c.copied_checkpoint(), "--max_steps", "1"),
        2,
        ["--max_steps 2 there, 1 here", "--overwrite_output_dir"],
    ),
    "resume with a larger --max_steps and another seed": Case(
        lambda c: c.args("--resume_from_checkpoint", c.copied_checkpoint(), "--max_steps", "4", "--seed", "7"),
        2,
        ["other arguments (--seed 0 there, 7 here)"],
    ),
    "resume with other data": Case(
        lambda c: c.args(
            "--resume_from_checkpoint", c.copied_checkpoint(), "--train_file", c.file("d.jsonl", JSONL_ROW)
        ),
        2,
        ["--train_file", "instructions.jsonl there", "d.jsonl here"],
    ),
    "resume with fewer training examples": Case(
        lambda c: c.args("--resume_from_checkpoint", c.copied_checkpoint(), "--max_train_samples", "3"),
        2,
        ["other arguments", "--max_train_samples (not set) there, 3 here"],
    ),
    "resume with another LoRA rank": Case(
        lambda c: c.args("--resume_from_checkpoint", c.copied_checkpoint(), "--lora_rank", "4"),
        2,
        ["other arguments", "--lora_rank 8 there, 4 here"],
    ),
    "resume an unrecorded checkpoint with another LoRA rank": Case(
        lambda c: c.args("--resume_from_checkpoint", c.copied_checkpoint(without_record), "--lora_rank", "4"),
        2,
        ["does not fit", "lora_A", "[8, 64]", "[4, 64]", "--lora_rank"],
        before_load=False,
    ),
    # the model
    "checkpoint folder without a tokenizer": Case(
        lambda c: c.args(
            model=Path(
                shutil.copytree(c.checkpoint, c.tmp / "no-tokenizer", ignore=shutil.ignore_patterns("tokenizer*"))
            )
        ),
        2,
        ["no-tokenizer", "has no tokenizer", "tokenizer.save_pretrained"],
        before_load=False,
    ),
    "truncated model.safetensors": Case(
        lambda c: c.args(model=truncated_weights(c)),
        2,
        ["truncated_weights/model.safetensors is damaged or truncated", "header claims", "the checkpoint is damaged"],
        before_load=False,
    ),
    "truncated .gguf": Case(
        lambda c: c.args(model=truncated_gguf(c.tmp)), 2, ["truncated.gguf", "truncated or damaged"], before_load=False
    ),
    # faults during training
    "non-finite loss": Case(
        lambda c: c.args(model=c.nan_checkpoint),
        1,
        ["loss is nan at step 1", "not saved", "--learning_rate"],
        before_load=False,
    ),
    "out of memory": Case(
        lambda c: c.args(),
        1,
        ["out of memory on cpu while training", "--per_device_train_batch_size 4", "--max_seq_length 64"],
        before_load=False,
        callbacks=lambda: [RaiseAt(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 2)],
    ),
    "Ctrl-C while saving a checkpoint": Case(
        lambda c: c.args(*SAVE_EVERY_STEP),
        130,
        ["interrupted: Ctrl-C while training", "checkpoint-1", "--resume_from_checkpoint True"],
        before_load=False,
        callbacks=lambda: [RaiseAt(KeyboardInterrupt(), 2, partial_checkpoint=True)],
    ),
}


def without_record(checkpoint: Path) -> None:
    """What a checkpoint saved by another tool (or before the run record existed) looks like."""
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["stateful_callbacks"]["RunArguments"]
    state_file.write_text(json.dumps(state))


def truncated_weights(context: Context) -> Path:
    copy = Path(shutil.copytree(context.checkpoint, context.tmp / "truncated_weights"))
    os.truncate(copy / "model.safetensors", 1000)
    return copy


def truncated_gguf(folder: Path) -> Path:
    path = write_gguf(folder / "truncated.gguf", arch="llama")
    os.truncate(path, path.stat().st_size - 64)
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    if not folder.is_dir():
        return {}
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


@pytest.mark.parametrize("name", CASES)
def test_bad_input_and_faults(name, script, checkpoint, earlier_run, nan_checkpoint, tmp_path, monkeypatch, capsys):
    case = CASES[name]
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    context = Context(tmp_path, checkpoint, earlier_run, nan_checkpoint)
    argv = case.argv(context)
    before = snapshot(context.out)
    if case.before_load:

        def must_not_load(*args, **kwargs):
            raise AssertionError("the model was loaded before the bad input was refused")

        monkeypatch.setattr(script, "load_model_and_tokenizer", must_not_load)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv, callbacks=case.callbacks())
    stderr = capsys.readouterr().err
    assert exit_info.value.code == case.status, stderr
    assert "Traceback" not in stderr
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith(PROG), last_line
    for word in case.words:
        assert word in last_line, (word, last_line)
    # Nothing of an earlier run changed, nothing half-written, and no adapter saved as a success.
    after = snapshot(context.out)
    if case.status == 2:
        assert after == before
    else:
        assert ADAPTER not in after and "all_results.json" not in after
        assert not [name for name in after if ".staging-" in name or name.endswith(".tmp")]
        for folder in context.out.glob("checkpoint-*"):
            assert (folder / "trainer_state.json").is_file(), f"{folder} is incomplete"
    if name == "Ctrl-C while saving a checkpoint":
        assert sorted(path.name for path in context.out.iterdir()) == ["checkpoint-1"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--max_steps", "-1", "--num_train_epochs", "0.5"],  # -1: train for the epochs, here half of one
        ["--max_steps", "3", "--num_train_epochs", "0"],  # a positive --max_steps overrides the epochs
        ["--save_strategy", "steps", "--save_steps", "0.5"],  # a fraction of the training's steps
        ["--save_strategy", "no", "--save_steps", "0"],  # no checkpoint asked for: --save_steps is not read
        ["--do_eval", "--max_steps", "0"],  # no training, so no step count to check (eval alone)
        # evaluation alone reads none of the training's values
        ["--do_eval", "--learning_rate", "0", "--per_device_train_batch_size", "0", "--adam_beta1", "2"],
        ["--optim", "sgd", "--adam_beta1", "2"],  # Adam's betas matter to Adam only
    ],
)
def test_step_counts_that_mean_something_in_transformers_are_accepted(extra, tmp_path):
    parser = HfArgumentParser((*ARGUMENT_CLASSES, TrainingArguments))
    argv = script_args(tmp_path / "model", tmp_path / "out", *extra)
    if "--do_eval" not in extra:
        argv.append("--do_train")
    args = parse_arguments(parser, argv)
    check_arguments(args.data, args.generation, args.training)


# --- what the refusals point to works ----------------------------------------------------------------------------


def test_overwrite_output_dir_replaces_the_earlier_run(script, checkpoint, earlier_run, tmp_path):
    output_dir = shutil.copytree(earlier_run, tmp_path / "out")
    earlier_adapter = (output_dir / ADAPTER).read_bytes()
    (output_dir / "eval_results.json").write_text('{"eval_loss": 1.0}')  # what an earlier run that evaluated left
    (output_dir / "generations.json").write_text("[]")
    (output_dir / "notes.txt").write_text("mine")
    script.main(script_args(checkpoint, output_dir, *TRAIN.split(), "--overwrite_output_dir", "--seed", "1"))
    assert (output_dir / ADAPTER).read_bytes() != earlier_adapter
    assert not (output_dir / "eval_results.json").exists() and not (output_dir / "generations.json").exists()
    assert "eval_loss" not in json.loads((output_dir / "all_results.json").read_text())
    assert (output_dir / "notes.txt").read_text() == "mine"  # the user's own files stay
    assert (output_dir / ADAPTER).stat().st_mode & 0o777 == 0o666 & ~current_umask()  # safetensors writes 0600
    assert not [path for path in output_dir.iterdir() if path.name.startswith(".")]


def test_resume_true_continues_from_the_last_checkpoint_and_keeps_the_others(
    script, checkpoint, earlier_run, tmp_path
):
    output_dir = shutil.copytree(earlier_run, tmp_path / "out")
    shutil.rmtree(output_dir / "checkpoint-2")
    kept = snapshot(output_dir / "checkpoint-1")
    extra = ["--resume_from_checkpoint", "True", *SAVE_EVERY_STEP]
    script.main(script_args(checkpoint, output_dir, *TRAIN.split(), *extra))
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1, 2]  # step 1 resumed
    assert snapshot(output_dir / "checkpoint-1") == kept


class LearningRates(TrainerCallback):
    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "learning_rate" in logs:
            self.by_step[state.global_step] = logs["learning_rate"]


def test_a_larger_max_steps_trains_longer_and_says_where_the_schedule_now_ends(
    script, checkpoint, earlier_run, tmp_path, caplog
):
    """As transformers' Trainer allows: checkpoint-2 of a 2-step run continues to step 4, its linear schedule
    rebuilt for 4 steps from the first resumed step on (step k runs at 5e-5 * (4 - (k - 1)) / 4, the rate logged;
    the Trainer alone would run step 3 at the 2-step schedule's final rate, 0)."""
    output_dir = shutil.copytree(earlier_run, tmp_path / "out")
    rates = LearningRates()
    argv = script_args(checkpoint, output_dir, *TRAIN.split(), "--resume_from_checkpoint", "True", "--max_steps", "4")
    with caplog.at_level("WARNING"):
        script.main(argv, callbacks=[rates])
    assert (
        "--resume_from_checkpoint: training longer than checkpoint-2's run (--max_steps 2 there, 4 here): the "
        "learning-rate schedule (linear) now ends at step 4 instead of 2." in caplog.text
    )
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and [entry["step"] for entry in state["log_history"] if "loss" in entry] == [
        1,
        2,
        3,
        4,
    ]
    assert rates.by_step.keys() >= {3, 4}
    for step in (3, 4):
        assert rates.by_step[step] == pytest.approx(5e-5 * (4 - (step - 1)) / 4)


class InterruptAfterSave(TrainerCallback):
    """Ctrl-C right after checkpoint-`step` is complete: a run killed between two checkpoints."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt


def test_overwrite_then_resume_continues_the_new_run_not_the_earlier_one(
    script, checkpoint, earlier_run, tmp_path, caplog
):
    """Run A left checkpoint-1 and -2; run B (--overwrite_output_dir, other learning rate and seed) is stopped after
    its checkpoint-1. A resume then continues B, and a resume with A's arguments is refused."""
    output_dir = shutil.copytree(earlier_run, tmp_path / "out")
    run_b = [*TRAIN.split(), *SAVE_EVERY_STEP, "--learning_rate", "5e-4", "--seed", "7", "--max_steps", "3"]
    with pytest.raises(SystemExit) as exit_info:
        script.main(script_args(checkpoint, output_dir, *run_b, "--overwrite_output_dir"), [InterruptAfterSave(1)])
    assert exit_info.value.code == 130
    removed = "checkpoint-1, checkpoint-2, all_results.json, train_results.json"  # the earlier run trained
    assert f"removed the earlier run's {removed} from {output_dir}" in caplog.text
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-1"]
    recorded = json.loads((output_dir / "checkpoint-1" / "trainer_state.json").read_text())
    assert recorded["stateful_callbacks"]["RunArguments"]["args"]["learning_rate"] == 5e-4

    with pytest.raises(SystemExit) as exit_info:  # run A's command line
        script.main(script_args(checkpoint, output_dir, *TRAIN.split(), "--resume_from_checkpoint", "True"))
    assert exit_info.value.code == 2

    script.main(script_args(checkpoint, output_dir, *run_b, "--resume_from_checkpoint", "True"))
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["max_steps"] == 3
    assert [entry["learning_rate"] for entry in state["log_history"] if "loss" in entry][0] == pytest.approx(5e-4)


def test_resuming_a_checkpoint_without_a_record_says_it_cannot_check(
    script, checkpoint, earlier_run, tmp_path, caplog
):
    output_dir = shutil.copytree(earlier_run, tmp_path / "out")
    shutil.rmtree(output_dir / "checkpoint-2")
    without_record(output_dir / "checkpoint-1")
    script.main(script_args(checkpoint, output_dir, *TRAIN.split(), "--resume_from_checkpoint", "True"))
    assert "holds no record of its run's arguments" in caplog.text
    assert json.loads((output_dir / "trainer_state.json").read_text())["global_step"] == 2


def test_results_replace_a_symlink_instead_of_writing_through_it(script, checkpoint, tmp_path):
    outside = tmp_path / "someone-elses.json"
    outside.write_text("precious")
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    (output_dir / "all_results.json").symlink_to(outside)
    script.main(script_args(checkpoint, output_dir, *TRAIN.split(), "--overwrite_output_dir"))
    assert outside.read_text() == "precious"
    results = output_dir / "all_results.json"
    assert not results.is_symlink() and json.loads(results.read_text())["train_loss"] > 0


def test_staging_left_by_a_killed_run_is_removed_and_does_not_count(script, checkpoint, tmp_path):
    output_dir = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = output_dir / f".staging-{socket.gethostname()}~{dead.pid}~beef.tmp"
    stale.mkdir(parents=True)
    (stale / ADAPTER).write_bytes(b"half")
    script.main(script_args(checkpoint, output_dir, *TRAIN.split()))
    assert not stale.exists() and (output_dir / ADAPTER).is_file()


def test_skipped_rows_are_counted(script, checkpoint, tmp_path, caplog):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "flash attention saves memory"}\n{"text": " "}\n' * 4)
    script.main(script_args(checkpoint, tmp_path / "out", *TRAIN.split(), "--train_file", str(data)))
    assert "skipped 4 rows with a blank text" in caplog.text
    caplog.clear()
    long_prompt = '{"instruction": "' + "word " * 80 + '", "output": "x"}\n'
    data.write_text(JSONL_ROW * 4 + long_prompt)
    script.main(script_args(checkpoint, tmp_path / "out2", *TRAIN.split(), "--train_file", str(data)))
    assert "Skipped 1 of 5 examples" in caplog.text
    caplog.clear()
    data.write_text(JSONL_ROW * 4 + '{"instruction": " ", "input": "", "output": ""}\n' * 2)
    script.main(script_args(checkpoint, tmp_path / "out3", *TRAIN.split(), "--train_file", str(data)))
    assert "skipped 2 rows whose instruction, input, output are all blank" in caplog.text


def test_rows_with_a_blank_response_are_counted(tmp_path, caplog):
    data = tmp_path / "d.jsonl"
    data.write_text(JSONL_ROW * 3 + '{"instruction": "Say nothing.", "output": " "}\n')
    dataset = finetuning_data.load_data_file(str(data), "--train_file")
    assert dataset.num_rows == 4  # kept: the end token is still something to learn
    assert f"--train_file {str(data)!r}: 1 of 4 rows have a blank 'output'" in caplog.text


def test_bf16_on_a_cpu_that_emulates_it_is_said_once(script, checkpoint, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: False)
    argv = [*TRAIN.split(), "--max_steps", "1", "--use_cpu", "--bf16", "True"]
    script.main(script_args(checkpoint, tmp_path / "out", *argv))
    assert caplog.text.count("bfloat16 on this CPU is emulated") == 1


# --- real signals during training, then a rerun that resumes -----------------------------------------------------


def start_training(checkpoint: Path, output_dir: Path, *extra: str) -> subprocess.Popen:
    argv = script_args(checkpoint, output_dir, *TRAIN.split(), *SAVE_EVERY_STEP, *extra)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "kill -9"])
def test_training_killed_then_resumed_loses_nothing(script, checkpoint, tmp_path, sig):
    output_dir = tmp_path / "out"
    process = start_training(checkpoint, output_dir, "--max_steps", "30")
    wait_for(output_dir / "checkpoint-2" / "trainer_state.json", process)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=120)
    if sig == signal.SIGINT:
        assert process.returncode == 130, stderr[-3000:]
        assert "Traceback" not in stderr
        assert stderr.strip().splitlines()[-1].startswith(f"{PROG}interrupted: Ctrl-C while training")
        # No partial files: every checkpoint is complete, nothing staged, no adapter claimed as final.
        names = [path.name for path in output_dir.iterdir()]
        assert all(name.startswith("checkpoint-") for name in names), names
        assert all((output_dir / name / "trainer_state.json").is_file() for name in names)
    else:
        assert process.returncode == -signal.SIGKILL
    complete = sorted(
        int(path.name.split("-")[1])
        for path in output_dir.glob("checkpoint-*")
        if (path / "trainer_state.json").is_file()
    )
    assert complete and complete[-1] < 30, complete  # stopped before its end
    kept = {step: snapshot(output_dir / f"checkpoint-{step}") for step in complete}

    # The rerun's exit status is not the point: in-process.
    resume = ["--resume_from_checkpoint", "True", "--max_steps", "30"]  # the same run: refused otherwise
    script.main(script_args(checkpoint, output_dir, *TRAIN.split(), *SAVE_EVERY_STEP, *resume))
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 30
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == list(range(1, 31))
    assert (output_dir / ADAPTER).is_file()
    for step, files in kept.items():
        assert snapshot(output_dir / f"checkpoint-{step}") == files, step
    assert not [path for path in output_dir.iterdir() if path.name.startswith(".")]


def test_ctrl_c_during_the_model_conversion_exits_130_and_leaves_no_staging(tmp_path):
    cache, marker = tmp_path / "cache", tmp_path / "converting"
    gguf_file = write_gguf(tmp_path / "tiny.gguf", arch="llama")
    argv = ["--model_name_or_path", str(gguf_file), "--output_dir", str(tmp_path / "out"), "--do_train"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), CACHE_ENV_VAR: str(cache)}
    process = subprocess.Popen(
        [sys.executable, str(DRIVER), "script", str(marker), str(SCRIPT), *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(marker, process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        f"{PROG}interrupted: Ctrl-C while loading the model: nothing was written to {tmp_path / 'out'}; "
        "run the same command again."
    )
    assert list((cache / "gguf").iterdir()) == []
    assert list((tmp_path / "out").iterdir()) == []


def test_more_epochs_continue_the_run_fewer_are_another_run(tmp_path):
    from optimum.habana.cli.finetuning import run_record

    checkpoint = tmp_path / "checkpoint-9"
    checkpoint.mkdir()
    recorded = {"num_train_epochs": 1.0, "max_steps": -1, "lr_scheduler_type": "cosine", "seed": 0}
    state = {"stateful_callbacks": {"RunArguments": {"args": recorded, "attributes": {}}}}
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    longer = {**recorded, "num_train_epochs": 3.0}
    assert run_record.resume_problem(checkpoint, longer) is None
    assert run_record.resume_notes(checkpoint, longer) == [
        "--resume_from_checkpoint: training longer than checkpoint-9's run (--num_train_epochs 1.0 there, 3.0 here): "
        "the learning-rate schedule (cosine) now ends at epoch 3.0 instead of 1.0."
    ]
    assert "--num_train_epochs 1.0 there, 0.5 here" in run_record.resume_problem(
        checkpoint, {**recorded, "num_train_epochs": 0.5}
    )
    # From epochs to steps is another run, not a longer one.
    assert "--max_steps -1 there, 50 here" in run_record.resume_problem(checkpoint, {**recorded, "max_steps": 50})
    assert run_record.resume_notes(checkpoint, recorded) == []


EXPLAIN_REFUSES = [
    "non-empty output_dir",
    "output_dir is a file",
    "--max_steps 0",
    "--per_device_eval_batch_size 0",
    "--gradient_accumulation_steps -1",
    "--lora_alpha 0",
]


@pytest.mark.parametrize("name", EXPLAIN_REFUSES)
def test_explain_refuses_the_command_lines_a_run_refuses(name, script, checkpoint, earlier_run, tmp_path, capsys):
    """--explain loads nothing and writes nothing, and refuses what the run would, in its words."""
    case = CASES[name]
    context = Context(tmp_path, checkpoint, earlier_run, checkpoint)
    argv = case.argv(context)
    before = snapshot(context.out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        script.main([*argv, "--explain"])
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and last_line.startswith(PROG), last_line
    assert all(word in last_line for word in case.words), last_line
    assert snapshot(context.out) == before


def test_explain_creates_no_output_folder(script, checkpoint, tmp_path, capsys):
    output_dir = tmp_path / "new" / "out"
    script.main(script_args(checkpoint, output_dir, *TRAIN.split(), "--explain"))
    assert "Model:" in capsys.readouterr().out and not (tmp_path / "new").exists()
