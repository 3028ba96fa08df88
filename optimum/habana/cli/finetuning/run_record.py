"""What a fine-tuning run was started with, saved in each of its checkpoints, so that a resume continues that run.

The Trainer writes every `ExportableState` callback's state into a checkpoint's `trainer_state.json`, the file it
writes last, so a complete checkpoint always carries its run's arguments. Resuming compares them with the command
line: a checkpoint of another run (another learning rate, seed, step count, model or data) is refused, naming the
differences, instead of silently mixing two runs.
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
    "train_file",
    "dataset_name",
    "dataset_config_name",
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
        if name in recorded and recorded[name] != value
    ]
    if not differences:
        return None
    return (
        f"{checkpoint} was saved by a run with other arguments ({'; '.join(differences)}). Resume with that run's "
        "arguments, or start a new run with --overwrite_output_dir (which removes the earlier run's checkpoints) "
        "or another --output_dir."
    )


def _shown(value: Any) -> str:
    if value is None:
        return "(not set)"
    if isinstance(value, list):
        return " ".join(str(item) for item in value)
    return str(value)
