"""What a fine-tuning run was started with, saved in each of its checkpoints, so that a resume continues that run.

The Trainer writes every `ExportableState` callback's state into a checkpoint's `trainer_state.json`, the file it
writes last, so a complete checkpoint always carries its run's arguments. Resuming compares them with the command
line: a checkpoint of another run (another learning rate, seed, model or data) is refused, naming the differences,
instead of silently mixing two runs. Training longer (a larger --max_steps or --num_train_epochs, as the Trainer
allows) continues the run, with a note that the learning-rate schedule now ends at the new step or epoch.
"""

import json
import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState


logger = logging.getLogger(__name__)


# The command-line arguments that define a run: resuming with another value would continue a different run.
RUN_DEFINING_ARGUMENTS = (
    "model_name_or_path",
    "model_revision",
    "train_file",
    "dataset_name",
    "dataset_config_name",
    "validation_split_percentage",  # takes the validation examples out of the training file
    "max_train_samples",
    "instruction_column_name",
    "input_column_name",
    "output_column_name",
    "keep_linebreaks",
    "max_seq_length",
    "dataset_concatenation",
    "train_on_inputs",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "seed",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "peft_type",
    "adalora_init_r",
    "adalora_target_r",
    "adalora_tinit",
    "adalora_tfinal",
    "adalora_delta_t",
    "adalora_orth_reg_weight",
    "ia3_target_modules",
    "feedforward_modules",
    "adapter_layers",
    "adapter_len",
    "vera_target_modules",
    "ln_target_modules",
    "chat_prompt",
    "sql_prompt",
    "dataset_seed",
    "config_name",
    "tokenizer_name",
)


# A larger value continues the same run for longer; the Trainer rebuilds its schedule for the new length.
LONGER = {"max_steps": "step", "num_train_epochs": "epoch"}


# Compared as absolute paths when they name something local, so that `data.jsonl` and `./data.jsonl` agree.
PATH_ARGUMENTS = ("model_name_or_path", "train_file")


class RunArguments(TrainerCallback, ExportableState):
    """Does nothing during training; its state (the run's arguments) is saved in every checkpoint."""

    def __init__(self, **arguments: Any) -> None:
        self.arguments = arguments

    def state(self) -> dict[str, Any]:
        return {"args": self.arguments, "attributes": {}}


def run_arguments(*argument_groups: Any) -> dict[str, Any]:
    """The run-defining values found in the parsed argument dataclasses, as JSON would store them."""
    values = {}
    for group in argument_groups:
        for name in RUN_DEFINING_ARGUMENTS:
            if hasattr(group, name):
                value = getattr(group, name)
                if name in PATH_ARGUMENTS and value is not None and Path(value).expanduser().exists():
                    value = str(Path(value).expanduser().resolve())
                values[name] = json.loads(json.dumps(value, default=str))
    return values


def recorded_arguments(checkpoint: Path) -> dict[str, Any] | None:
    """The arguments saved in a checkpoint's trainer state, or None for a checkpoint saved without them."""
    state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    recorded = (state.get("stateful_callbacks") or {}).get(RunArguments.__name__)
    if isinstance(recorded, list):  # the Trainer keeps a list when several callbacks share the class name
        recorded = recorded[-1] if recorded else None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("args"), dict):
        return None
    return recorded["args"]


def resume_problem(checkpoint: Path, current: dict[str, Any]) -> str | None:
    """Why resuming `checkpoint` with the `current` arguments would continue another run, or None when it may.

    A checkpoint saved without a record (by another tool, or before records were kept) cannot be checked: one
    warning says so and the resume goes ahead, as asked.
    """
    recorded = recorded_arguments(checkpoint)
    if recorded is None:
        logger.warning(
            "%s holds no record of its run's arguments (saved by another tool or an older version): resuming "
            "without checking that they match this command line.",
            checkpoint,
        )
        return None
    differences = [
        f"--{name} {_shown(recorded[name])} there, {_shown(value)} here"
        for name, value in current.items()
        if name in recorded and recorded[name] != value and not _longer(name, recorded[name], value)
    ]
    if not differences:
        return None
    return (
        f"{checkpoint} was saved by a run with other arguments ({'; '.join(differences)}). Resume with that run's "
        "arguments, or start a new run with --overwrite_output_dir (which removes the earlier run's checkpoints) "
        "or another --output_dir."
    )


def resume_notes(checkpoint: Path, current: dict[str, Any]) -> list[str]:
    """What resuming with a larger --max_steps / --num_train_epochs changes: where the schedule now ends."""
    recorded = recorded_arguments(checkpoint) or {}
    schedule = current.get("lr_scheduler_type") or "linear"
    return [
        f"--resume_from_checkpoint: training longer than {checkpoint.name}'s run (--{name} {_shown(recorded[name])} "
        f"there, {_shown(current[name])} here): the learning-rate schedule ({schedule}) now ends at {unit} "
        f"{_shown(current[name])} instead of {_shown(recorded[name])}."
        for name, unit in LONGER.items()
        if name in recorded and name in current and _longer(name, recorded[name], current[name])
    ]


class LongerRunSchedule(TrainerCallback):
    """On a resume that trains longer: the first resumed step at the rebuilt schedule's rate. The Trainer builds
    the schedule for the new length but restores the optimizer's rate from the checkpoint, where the shorter
    schedule left it (0 at the end of a linear one), so that step would run at the old rate."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer, scheduler = kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        lambdas = getattr(scheduler, "lr_lambdas", None)  # LambdaLR: every schedule of transformers' get_scheduler
        if optimizer is None or not lambdas:
            return
        rates = [base * rate(scheduler.last_epoch) for base, rate in zip(scheduler.base_lrs, lambdas, strict=True)]
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        scheduler._last_lr = rates  # what get_last_lr() (the logged learning_rate) answers until the next step


def _longer(name: str, recorded: Any, value: Any) -> bool:
    """A larger positive step or epoch count than the checkpoint's run: the same run, trained for longer."""
    numbers = all(isinstance(item, (int, float)) and not isinstance(item, bool) for item in (recorded, value))
    return name in LONGER and numbers and 0 < recorded < value


def _shown(value: Any) -> str:
    if value is None:
        return "(not set)"
    if isinstance(value, list):
        return " ".join(str(item) for item in value)
    return str(value)
