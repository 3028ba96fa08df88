"""run_lm_eval.py's tasks and output: which task folders are searched, the data checked before the model loads,
lm-eval's log lines, and the results file.

The two tasks shipped in `tasks/` (essay_perplexity, flash_mc) are always registered. Indexing lm-eval's
own ~15,000 task files takes tens of seconds, so it happens only when a requested name is not among the shipped
tasks and the user's --include_path folders (see `select_tasks`). Each task's data is loaded once before the model: a task whose
dataset lives on the Hugging Face Hub fails there with one line that names it and says how to run offline.
"""

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lm_eval.tasks
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable, make_table

from optimum.habana.utils.atomic import atomic_write_text, atomic_write_text_beside


SHIPPED_TASKS_DIR = Path(__file__).parent / "tasks"


LM_EVAL_TASKS_DIR = Path(lm_eval.tasks.__file__).parent


SHIPPED_TASKS = ("essay_perplexity", "flash_mc")


OFFLINE_HINT = (
    "To run it offline, run it once with network access so that `datasets` caches it, then set "
    "HF_DATASETS_OFFLINE=1 (and HF_HUB_OFFLINE=1); or evaluate the shipped offline tasks: --tasks "
    + " ".join(SHIPPED_TASKS)
    + "."
)


# lm-eval's log lines that only describe how this script calls it (a loaded model, the shipped tasks' loaders).
_EXPECTED_LOG_LINES = (
    "`pretrained` model kwarg is not of type `str`",
    "Passed an already-initialized model through `pretrained`",
    "Custom kwargs can be passed to `--metadata`",
)


class TaskDataError(RuntimeError):
    """A task whose data cannot be loaded (the hub unreachable, a file missing); the message is one line."""


@dataclass
class TaskSelection:
    manager: TaskManager
    names: list[str]  # task, group or tag names and YAML paths, patterns expanded


def select_tasks(tasks: Sequence[str], include_path: Sequence[str] | None) -> TaskSelection:
    """The task manager to use and the names to evaluate; a ValueError names unknown tasks.

    Indexes grow only as needed: the shipped and --include_path folders; then also lm-eval's folders named after
    the requested tasks (lm-eval keeps most tasks in a folder of their own name); then all of lm-eval's tasks. A
    smaller index is used only when every name is a single task there: one YAML file, with what it includes by
    path. A group or tag may list tasks defined anywhere, so those always get the whole index.
    """
    folders = [str(SHIPPED_TASKS_DIR), *(str(Path(folder).expanduser()) for folder in include_path or [])]
    own_folders = [str(LM_EVAL_TASKS_DIR / name) for name in tasks if (LM_EVAL_TASKS_DIR / name).is_dir()]
    for searched in ([], own_folders) if own_folders else ([],):
        manager = TaskManager(include_defaults=False, include_path=[*searched, *folders])  # later folders win
        if all(name in manager.all_subtasks for name in tasks):
            return TaskSelection(manager, list(tasks))
    manager = TaskManager(include_path=folders)
    names, unknown = [], []
    for name in tasks:
        if name in manager.all_tasks or Path(name).is_file():
            names.append(name)
        elif matches := manager.match_tasks([name]):
            names += [match for match in matches if match not in names]
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(
            f"--tasks: no task named {', '.join(map(repr, unknown))} in lm-eval, the shipped tasks "
            f"({', '.join(SHIPPED_TASKS)}) or --include_path. `lm-eval ls tasks` lists lm-eval's."
        )
    return TaskSelection(manager, names)


def check_task_data(selection: TaskSelection) -> list[Any]:
    """Build every task once (which loads its data), so a missing dataset stops the run before the model loads;
    returns what was built, one entry per name (e.g. for counting the tasks' few-shot examples)."""
    load = getattr(selection.manager, "load", None) or selection.manager.load_task_or_group  # lm-eval < 0.4.10
    built = []
    for name in selection.names:
        try:
            built.append(load([name]))
        except ConnectionError as error:
            raise TaskDataError(
                f"--tasks {name} needs its dataset from the Hugging Face Hub, which cannot be reached "
                f"({first_line(error)}). {OFFLINE_HINT}"
            ) from None
        except OSError as error:
            hub = "hub" in str(error).lower() or "offline" in str(error).lower()
            hint = f" {OFFLINE_HINT}" if hub else ""
            raise TaskDataError(f"--tasks {name}: its data cannot be loaded ({first_line(error)}).{hint}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise TaskDataError(
                f"--tasks {name}: the task cannot be built ({type(error).__name__}: {first_line(error)}); check its "
                "YAML file."
            ) from None
    return built


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class _ExpectedLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(line in message for line in _EXPECTED_LOG_LINES)


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a message comes: a caller that swaps stderr between two runs in one
    process (a notebook, a test) never gets a closed stream."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # StreamHandler.__init__ assigns it; the property above always answers


def configure_lm_eval_logging() -> None:
    """lm-eval's warnings on stderr, without the few that only describe how this script calls it."""
    logger = logging.getLogger("lm_eval")
    if not any(isinstance(handler, _CurrentStderr) for handler in logger.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("lm-eval: %(message)s"))
        handler.addFilter(_ExpectedLines())
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False


def write_results(path: Path, results: dict[str, Any], overwrite: bool = False) -> Path:
    """The results JSON, written atomically: a killed run leaves the earlier file (or none). Without `overwrite`, a
    file that appeared at `path` during the run (another evaluation's) is kept, and these results take the first free
    name beside it (`results-1.json`, ...); the caller says where they went."""
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)  # checked writable at the start (`check_output_file`)
    return atomic_write_text(path, text) if overwrite else atomic_write_text_beside(path, text)


def summary_tables(results: dict[str, Any]) -> str:
    """lm-eval's own tables: one row per task and metric, and the groups' when there are any."""
    tables = [make_table(results)]
    if results.get("groups"):
        tables.append(make_table(results, "groups"))
    return "\n".join(tables)


def score_rows(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each task's metrics (lm-eval's `metric,filter` keys, stderr excluded), e.g. for comparing two runs."""
    rows = {}
    for task, metrics in results.get("results", {}).items():
        rows[task] = {
            key.split(",")[0]: value
            for key, value in metrics.items()
            if "," in key and "_stderr" not in key and isinstance(value, (int, float))
        }
    return rows
