"""run_lora_clm.py's checkpoints: resumed from the last complete one, removed when asked, and the final files
published whole.

Final files are written into a staging folder inside the output folder and then moved into place one by one with
`os.replace`: a run killed at any point leaves every file either as the earlier run wrote it or as this run did.
Staging folders of killed runs are removed by the next run (see `optimum.habana.utils.staging`).
"""

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from optimum.habana.cli.common import STAGING_PREFIX, OutputDirError
from optimum.habana.utils.atomic import current_umask
from optimum.habana.utils.staging import make_staging_folder


logger = logging.getLogger(__name__)


CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")


# Written last into a Trainer checkpoint (Trainer._save_checkpoint): a checkpoint folder without it is incomplete.
TRAINER_STATE_NAME = "trainer_state.json"


TRUE_VALUES = {"true", "1", "yes"}


FALSE_VALUES = {"false", "0", "no", ""}


def parse_resume_value(value: str | None) -> str | bool | None:
    """`--resume_from_checkpoint` as transformers users write it: True/False, or a checkpoint path."""
    if value is None:
        return None
    if value.strip().lower() in TRUE_VALUES:
        return True
    if value.strip().lower() in FALSE_VALUES:
        return None
    return value


def resolve_checkpoint(value: str | bool | None, output_dir: Path) -> Path | None:
    """The checkpoint folder to resume from: True means the last complete `checkpoint-N` in `output_dir`."""
    if value is None:
        return None
    if value is True:
        checkpoint = last_complete_checkpoint(output_dir, remove_incomplete=True)
        if checkpoint is None:
            raise OutputDirError(
                f"--resume_from_checkpoint True: {output_dir} holds no complete checkpoint-N folder to resume from. "
                "Checkpoints are saved with --save_strategy steps --save_steps N (or epoch); pass a checkpoint "
                "folder, or leave the flag out to start afresh."
            )
        return checkpoint
    checkpoint = Path(value).expanduser()
    if not checkpoint.is_dir():
        raise OutputDirError(
            f"--resume_from_checkpoint {value!r} is not a folder; pass a checkpoint-N folder or True."
        )
    problem = checkpoint_problem(checkpoint)
    if problem is not None:
        raise OutputDirError(f"--resume_from_checkpoint {value!r} cannot be resumed from: {problem}.")
    return checkpoint


def checkpoints(output_dir: Path) -> list[Path]:
    """The `checkpoint-N` folders, by step."""
    found = [entry for entry in output_dir.iterdir() if CHECKPOINT_PATTERN.match(entry.name) and entry.is_dir()]
    return sorted(found, key=lambda entry: int(CHECKPOINT_PATTERN.match(entry.name).group(1)))


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why the Trainer could not resume from this folder, or None when it is complete."""
    state = checkpoint / TRAINER_STATE_NAME
    if not state.is_file():
        return f"it has no {TRAINER_STATE_NAME} (the run saving it was killed before it finished)"
    try:
        json.loads(state.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{state} is damaged ({error})"
    return None


def last_complete_checkpoint(output_dir: Path, remove_incomplete: bool = False) -> Path | None:
    """The last checkpoint the Trainer finished writing; with `remove_incomplete`, later incomplete ones are
    reported and removed.

    Removal is for resuming only, i.e. when the user said the folder is theirs to continue: a checkpoint folder
    without its trainer state is what a run killed while saving leaves, and nothing can resume from it.
    """
    for checkpoint in reversed(checkpoints(output_dir)):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        if remove_incomplete:
            logger.warning("Removing the incomplete checkpoint %s: %s.", checkpoint, problem)
            shutil.rmtree(checkpoint, ignore_errors=True)
    return None


def continues_the_run_in(resume: str | bool | None, output_dir: str) -> bool:
    """Whether `--resume_from_checkpoint` continues the run saved in `output_dir` (True, or one of its checkpoints):
    only then may a resumed run write over the files there. A checkpoint saved elsewhere continues another run."""
    if resume is None:
        return False
    return resume is True or Path(output_dir).expanduser().resolve() in Path(resume).expanduser().resolve().parents


def check_overwrite_and_resume(overwrite: bool, resume: str | bool | None, output_dir: str) -> None:
    """--overwrite_output_dir starts afresh, removing the earlier checkpoints: it cannot also resume from them."""
    if not overwrite or resume is None:
        return
    if continues_the_run_in(resume, output_dir):
        raise OutputDirError(
            f"--overwrite_output_dir and --resume_from_checkpoint {resume} contradict each other: the first starts a "
            f"new run and removes the checkpoints in {output_dir}, the second continues from one of them. Choose one."
        )


# The earlier run's metrics and samples: a run that does not evaluate (or sample) would leave them beside its own
# results, read as its own.
RESULT_FILES = ("all_results.json", "train_results.json", "eval_results.json", "generations.json")


def remove_earlier_checkpoints(output_dir: Path) -> None:
    """What --overwrite_output_dir does first: no later --resume_from_checkpoint can continue the earlier run, and
    none of its results is left to be read as the new run's."""
    removed = remove_checkpoints(output_dir)
    results = [name for name in RESULT_FILES if (output_dir / name).is_file()]
    for name in results:
        (output_dir / name).unlink()
    if removed or results:
        logger.warning(
            "--overwrite_output_dir: removed the earlier run's %s from %s, so that no resume continues that run and "
            "none of its results is read as this run's.",
            ", ".join(removed + results),
            output_dir,
        )


def remove_checkpoints(output_dir: Path) -> list[str]:
    """Remove every `checkpoint-N` folder (an earlier run's, on --overwrite_output_dir); returns their names.

    Each is first renamed to a staging name (atomic), so a run killed meanwhile leaves no half-removed checkpoint
    that a resume could take for complete: the next run removes the renamed folder as stale staging.
    """
    removed = []
    for checkpoint in checkpoints(output_dir):
        doomed = make_staging_folder(output_dir, STAGING_PREFIX)
        os.replace(checkpoint, doomed / checkpoint.name)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(checkpoint.name)
    return removed


def remove_incomplete_checkpoints(output_dir: Path, keep: set[str]) -> list[Path]:
    """Remove the checkpoint folders not in `keep` that are incomplete: what an interrupted run was writing."""
    removed = []
    for checkpoint in checkpoints(output_dir):
        if checkpoint.name not in keep and checkpoint_problem(checkpoint) is not None:
            shutil.rmtree(checkpoint, ignore_errors=True)
            removed.append(checkpoint)
    return removed


@contextlib.contextmanager
def publishing(output_dir: Path) -> Iterator[Path]:
    """A staging folder to write final files into; on success each is moved into `output_dir` atomically.

    On any exception (Ctrl-C included) nothing is moved and the staging folder is removed.
    """
    staging = make_staging_folder(output_dir, STAGING_PREFIX)
    try:
        yield staging
        publish(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, output_dir: Path) -> None:
    """Move every file of `staging` to the same place under `output_dir`, each with a durable atomic rename.

    The files get the permissions the user's umask gives (some writers, safetensors among them, create 0600 files).
    """
    mode = 0o666 & ~current_umask()
    for source in sorted(path for path in staging.rglob("*") if path.is_file()):
        destination = output_dir / source.relative_to(staging)
        destination.parent.mkdir(parents=True, exist_ok=True)
        with open(source, "rb") as file:
            os.fsync(file.fileno())
        os.chmod(source, mode)
        os.replace(source, destination)
