"""What the tasks' prompts ask of run_lm_eval.py's command line, checked before the model runs: a chat template for
--apply_chat_template (or --chat), and as many few-shot examples in each task as -f/--num_fewshot asks for.

lm-eval finds either out only while it builds the first prompt, with a traceback: transformers' "tokenizer.chat_template
is not set", or `random.sample`'s "Sample larger than population" (lm-eval draws the few-shot examples of a prompt
from the task's few-shot split without replacement, one more when that split is the evaluated one, so that the
evaluated document can be left out).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lm_eval.api.task import ConfigurableTask, Task
from transformers import PreTrainedTokenizerBase


def chat_template_flag(apply_chat_template: str | bool | None, chat: bool) -> str | None:
    """The flag that asked for the chat template (--apply_chat_template wins), or None."""
    if apply_chat_template:
        return "--apply_chat_template"
    return "--chat" if chat else None


def check_chat_template(tokenizer: PreTrainedTokenizerBase, template: str | bool | None, flag: str) -> None:
    """The template lm-eval will pick exists: the tokenizer's own, its "default" one, or the one named.

    `template` is --apply_chat_template's value: True for the tokenizer's template, or the name of one of several.
    A ValueError names the flag.
    """
    templates = getattr(tokenizer, "chat_template", None)
    if not templates:
        raise ValueError(
            f"{flag}: the model's tokenizer has no chat template. Drop {flag} to evaluate the tasks' prompts as they "
            "are, or evaluate a chat model (one whose tokenizer_config.json or chat_template.jinja holds a template)."
        )
    if not isinstance(templates, dict):
        if isinstance(template, str):  # lm-eval would use the one template and warn only with a results tracker
            raise ValueError(
                f"{flag} {template}: the tokenizer has one chat template, without a name; pass {flag} alone to use it."
            )
        return
    names = ", ".join(sorted(templates))
    if isinstance(template, str):
        if template not in templates:
            raise ValueError(
                f"{flag} {template}: the tokenizer has no chat template of that name; its templates: {names}."
            )
    elif "default" not in templates:
        raise ValueError(
            f"{flag}: the tokenizer has several chat templates and none named 'default': name one, {flag} NAME "
            f"(its templates: {names})."
        )


@dataclass(frozen=True)
class FewshotPool:
    """How many few-shot examples one task can put in a prompt."""

    task: str
    examples: int | None  # None: the task's class does not say before it runs
    fixed_at_zero: bool = False  # the task's YAML sets num_fewshot: 0, which lm-eval keeps over -f/--num_fewshot


def leaf_tasks(built: Any) -> list[Task]:
    """The tasks in what lm-eval's task manager built (a dict of tasks, groups and their maps, nested or flat)."""
    found: dict[int, Task] = {}

    def visit(item: Any) -> None:
        if isinstance(item, Task):
            found.setdefault(id(item), item)
        elif isinstance(item, dict):
            for value in item.values():
                visit(value)
        elif isinstance(item, (list, tuple)):
            for value in item:
                visit(value)

    visit(built)
    return list(found.values())


def fewshot_pool(task: Task) -> FewshotPool:
    """The task's few-shot examples, as lm-eval's sampler holds them, less the evaluated document when it may be
    among them (few-shot split and evaluated split the same)."""
    config = getattr(task, "config", None)
    name = str(getattr(config, "task", None) or type(task).__name__)
    fixed_at_zero = getattr(config, "num_fewshot", None) == 0
    sampler = getattr(task, "sampler", None)
    if sampler is None:  # a configured task without few-shot documents has no sampler at all
        return FewshotPool(name, 0 if isinstance(task, ConfigurableTask) else None, fixed_at_zero)
    # lm-eval 0.4.11 and later: fewshot_docs() (the indices of fewshot_config applied); 0.4.10: the docs attribute.
    docs = (
        sampler.fewshot_docs() if callable(getattr(sampler, "fewshot_docs", None)) else getattr(sampler, "docs", None)
    )
    if docs is None:
        return FewshotPool(name, None, fixed_at_zero)
    fewshot_config = getattr(task, "fewshot_cfg", None)
    split = (
        getattr(fewshot_config, "split", None)
        if fewshot_config is not None
        else getattr(config, "fewshot_split", None)
    )
    same_split = split is not None and split == getattr(config, "test_split", None)
    return FewshotPool(name, max(len(docs) - same_split, 0), fixed_at_zero)


def fewshot_pools(built_tasks: Sequence[Any]) -> list[FewshotPool]:
    """One pool per task in what `harness.check_task_data` built."""
    return [fewshot_pool(task) for task in leaf_tasks(list(built_tasks))]


def check_num_fewshot(num_fewshot: int | None, pools: Sequence[FewshotPool]) -> list[str]:
    """Refuse more few-shot examples than a task holds (a ValueError naming -f/--num_fewshot and the tasks);
    returns one note per task whose own 0 lm-eval keeps over the flag."""
    if not num_fewshot:
        return []
    flag = f"-f/--num_fewshot {num_fewshot}"
    notes = [
        f"{flag}: {pool.task} sets num_fewshot: 0 in its YAML file, which lm-eval keeps: its prompts get no examples."
        for pool in pools
        if pool.fixed_at_zero
    ]
    short = [
        pool for pool in pools if not pool.fixed_at_zero and pool.examples is not None and pool.examples < num_fewshot
    ]
    if short:
        held = ", ".join(f"{pool.task} has {pool.examples}" for pool in short)
        most = min(pool.examples or 0 for pool in short)
        advice = f"pass {most} or fewer" if most else "drop it"
        raise ValueError(
            f"{flag}: more few-shot examples than the tasks hold ({held}); {advice}, or leave it out for each "
            "task's own number."
        )
    return notes


def check_num_fewshot_fits(num_fewshot: int | None, pools: Sequence[FewshotPool], max_length: int) -> None:
    """For tasks whose examples cannot be counted before the run: each example takes at least one token of the
    model's context, so more examples than that context has tokens cannot all be shown."""
    unknown = [pool.task for pool in pools if pool.examples is None and not pool.fixed_at_zero]
    if unknown and num_fewshot and num_fewshot > max_length:
        raise ValueError(
            f"-f/--num_fewshot {num_fewshot}: {', '.join(unknown)} cannot count their few-shot examples before the "
            f"run, and {num_fewshot} examples (a token each at the very least) cannot fit the model's {max_length}-token "
            "context: pass fewer."
        )
