"""The docs' commands and snippets run as written, shrunk: README.md, docs/continuous_batching.md and
docs/fine_tuning.md, as a new user would run them from the repository's root.

Each fenced `bash` block runs in bash in an empty folder (its files, e.g. `prompts.jsonl`, are written for real),
with `python` and `make` as shell functions that record their calls instead: bash itself expands the loops,
variables, `$'...'` strings and heredocs. Each recorded `python examples/X.py ARGS` then runs as X's `main(argv)`
in this process, with the sizes shrunk (`SHRINK`: a tiny random Llama instead of the embedded SmolLM2, fewer steps,
tokens and requests; benchmark workers in this process); `python -` runs its heredoc. Each `python` block runs
with the embedded model's path replaced by the tiny checkpoint. `make install`, `make test` and `make test-families`
are not run (they are what CI runs), nor the server's commands (tests/serving).
"""

import contextlib
import io
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

from optimum.habana.utils.model_loading import CACHE_ENV_VAR
from tests.helpers import ROOT, load_script, save_tiny_checkpoint


DOCS = ("README.md", "docs/continuous_batching.md", "docs/fine_tuning.md")


# Commands of other engineers' parts, run by their own tests.
NOT_HERE = ("optimum.habana.serve",)


@dataclass
class Block:
    doc: str
    line: int
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
        start = language = None
        for number, line in enumerate(lines, start=1):
            if line.startswith("```") and start is None:
                start, language = number, line[3:].strip()
            elif line.startswith("```"):
                code = "\n".join(lines[start : number - 1]) + "\n"
                if language in ("bash", "python") and not any(word in code for word in NOT_HERE):
                    found.append(Block(doc, start, language, code))
                start = None
    return found


SHIM = r"""
record() { printf '%s\0' "$@" >> "$DOCS_RECORD"; }
python() {
    if [ "$1" = "-" ]; then record CALL "$@" STDIN "$(cat)" END; else record CALL "$@" END; fi
}
make() { record MAKE "$@" END; }
set -e
"""


def recorded_calls(code: str, folder: Path) -> list[list[str]]:
    """What the block's `python` and `make` calls would run, in order: [kind, *arguments] each."""
    record = folder / ".calls"
    record.write_bytes(b"")
    done = subprocess.run(
        ["bash", "-c", SHIM + code], cwd=folder, env={"DOCS_RECORD": str(record), "PATH": "/usr/bin:/bin"}
    )
    assert done.returncode == 0, f"bash stopped with status {done.returncode}"
    fields = iter(record.read_bytes().decode().split("\0")[:-1])
    calls = []
    for kind in fields:
        call = [kind]
        for field in fields:
            if field == "END":
                break
            call.append(field)
            if field == "STDIN":  # the heredoc, one field, whatever it holds
                call.append(next(fields))
        calls.append(call)
    return calls


# --- shrinking ------------------------------------------------------------------------------------------------------


def replaced(argv: list[str], flag: str, value: str | Callable[[str], str]) -> list[str]:
    """`argv` with the value after `flag` replaced (by `value` or `value(old)`), when the flag is there."""
    argv = list(argv)
    for index, token in enumerate(argv[:-1]):
        if token == flag:
            argv[index + 1] = value(argv[index + 1]) if callable(value) else value
    return argv


def shrink(script: str, argv: list[str], tiny: Path) -> list[str]:
    """A doc's command line with the sizes of a test: said in each doc that a test runs its commands shrunk."""
    model = ["--model_name_or_path", str(tiny)]
    if script == "run_generation.py":
        argv = replaced(argv, "--batch_size", "4")
        return [*argv, *model, "--warmup", "0", "--n_iterations", "1", "--max_new_tokens", "4"]
    if script == "run_lora_clm.py":
        argv = replaced(replaced(argv, "--max_steps", "2"), "--per_device_train_batch_size", "2")
        limits = ["--max_train_samples", "8", "--max_eval_samples", "4", "--dataloader_pin_memory", "False"]
        # The tiny model's 128 positions (the last --max_seq_length given counts).
        return [*argv, *model, "--max_seq_length", "128", *limits, "--report_to", "none", "--disable_tqdm", "True"]
    if script == "run_lm_eval.py":
        return [*argv, *model, "-L", "2", "--batch_size", "4"]
    if script == "benchmark_continuous_batching.py":
        sizes = ["--requests", "3", "--min_prompt_tokens", "8", "--max_prompt_tokens", "24", "--max_new_tokens", "4"]
        return [*argv, "--model", str(tiny), *sizes]
    if script == "benchmark_training.py":
        argv = replaced(replaced(argv, "--layers", "1"), "--timed_steps", "1")
        index = argv.index("--tokens")
        end = next((i for i in range(index + 1, len(argv)) if argv[i].startswith("--")), len(argv))
        return [*argv[: index + 1], "16", *argv[end:], "--intermediate_size", "64"]
    raise AssertionError(f"no shrinking rule for {script}: add one to tests/test_docs.py")


def in_process_workers(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The benchmarks' workers in this process (the sizes are tiny; a process each costs seconds of imports);
    returns benchmark_training.py as a module, with its worker so replaced."""
    from optimum.habana.cli.benchmarks import workers
    from optimum.habana.cli.benchmarks.continuous_batching import worker as cb_worker
    from optimum.habana.cli.benchmarks.training import worker as training_worker

    monkeypatch.setattr(workers, "run_worker", lambda task, timeout, worker: cb_worker.measure(task))
    training = load_script("examples/language-modeling/benchmark_training.py")
    # No allocation cap in this process: only a worker process of its own may cap itself.
    measure = training_worker.measure_training
    monkeypatch.setattr(training, "run_worker", lambda task, timeout: measure({**task, "memory_limit_bytes": None}))
    return training


# --- running ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama_docs"))


@pytest.fixture(autouse=True)
def _offline_one_thread(monkeypatch, tmp_path_factory):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path_factory.getbasetemp() / "docs_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_python_call(arguments: list[str], tiny: Path, scripts: dict, stdin: str | None) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        if arguments == ["-"]:
            exec(compile(stdin, "<heredoc>", "exec"), {"__name__": "__main__"})
        else:
            path, *argv = arguments
            assert (ROOT / path).is_file(), f"{path}: no such script in the repository"
            script = scripts.get(path) or load_script(path)
            result = script.main(shrink(Path(path).name, argv, tiny))
            assert result == 0 or isinstance(result, dict), f"{path} returned {result!r}"
    return printed.getvalue()


EMBEDDED = "resolve_model(None).path"


@pytest.mark.parametrize("block", blocks(), ids=lambda block: block.name)
def test_the_docs_commands_and_snippets_run_as_written(block, tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if block.language == "python":
        assert EMBEDDED in block.code, "a snippet should load the embedded model (the test swaps in a tiny one)"
        code = block.code.replace(EMBEDDED, repr(str(tiny)))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, block.name, "exec"), {"__name__": "__main__"})
        assert printed.getvalue().strip(), "the snippet printed nothing"
        return
    scripts = {"examples/language-modeling/benchmark_training.py": in_process_workers(monkeypatch)}
    calls = recorded_calls(block.code, tmp_path)
    assert calls, "no command in the block"
    for kind, *arguments in calls:
        if kind == "MAKE":
            assert arguments[0] in ("install", "test", "test-families"), arguments  # what CI runs itself
            continue
        stdin = None
        if "STDIN" in arguments:
            stdin = arguments.pop(arguments.index("STDIN") + 1)
            arguments.remove("STDIN")
        printed = run_python_call(arguments, tiny, scripts, stdin)
        assert printed.strip(), f"{arguments[0]} printed nothing"


def test_every_tested_doc_says_its_commands_are_tested_shrunk():
    for doc in DOCS:
        assert re.search(r"tests/test_docs\.py", (ROOT / doc).read_text()), doc
