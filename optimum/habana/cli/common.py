"""What every example script shares: the attention flags as arguments, the checks of numbers, Ctrl-C and out of
memory as one line, the output folder, and the versions and hardware a result was measured on.

`exit_on_interrupt_or_oom` wraps the part of a script that loads, trains or generates. The script says what to
report (the phase, the batch and lengths that ran out of memory, what was kept) and what to clean up (partial
files); the exit status is 130 for Ctrl-C, as shells use for SIGINT, 143 for SIGTERM where a script asks for it
(`sigterm=True`), and 1 for out of memory. `stop_signals_deferred` holds both signals while files that must agree
are written.
"""

import contextlib
import json
import logging
import math
import os
import platform
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import field, fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from optimum.habana.kernels.cpu_decode import turned_on as cpu_decode_kernel_on
from optimum.habana.transformers.attention_flags import AttentionFlags
from optimum.habana.utils.staging import remove_stale_staging
from optimum.habana.version import __version__


logger = logging.getLogger(__name__)


def _attention_flags(self) -> AttentionFlags:
    """The validated flags; a ValueError names the offending combination."""
    return AttentionFlags(**{flag.name: getattr(self, flag.name) for flag in fields(AttentionFlags)})


# One command-line switch per attention flag (`--use_flash_attention`, or `--use_flash_attention True`), with the
# flag's own default and help text: adding a flag to AttentionFlags adds it here.
AttentionArguments = make_dataclass(
    "AttentionArguments",
    [
        (flag.name, flag.type, field(default=flag.default, metadata={"help": flag.metadata["help"]}))
        for flag in fields(AttentionFlags)
    ],
    namespace={"_argument_group_name": "flash attention", "attention_flags": _attention_flags},
)


AttentionArguments.__module__ = __name__
AttentionArguments.__doc__ = "The attention flags, one command-line switch each."


# Long English prose written for this project (Apache-2.0), about 11,000 tokens: run_generation.py --book_source, the
# fidelity table's text, the lm-eval essay task, the continuous-batching benchmark's requests.
LONG_PROMPT_PATH = Path(__file__).parent / "data" / "long_prompt.txt"
# numpy's global generator, which transformers' set_seed seeds too, takes seeds in [0, 2**32).
SEED_RANGE = range(2**32)


def check_finite_numbers(*arguments: object) -> None:
    """Refuse nan and inf in any float argument of the given dataclasses or argparse namespaces.

    Python's float() parses "nan" and "inf", so argparse and HfArgumentParser let them through; a nan learning rate
    or LoRA alpha then trains a nan model without a word. Call it right after parsing, before anything is loaded.
    Raises ValueError naming the flag (`--field_name`) and the value.
    """
    for argument in arguments:
        for name, value in _argument_values(argument):
            values = value if isinstance(value, (list, tuple)) else [value]
            for item in values:
                if isinstance(item, float) and not math.isfinite(item):
                    raise ValueError(f"--{name} must be a finite number, got {item}.")


def check_environment(prog: str) -> None:
    """The library's environment switches, read right after parsing: a bad value is the script's usage error (one
    line naming the variable and its values, exit 2) before any model loads, not a traceback at the first decode
    step."""
    try:
        cpu_decode_kernel_on()
    except ValueError as error:
        sys.stderr.write(f"{prog}: error: {error}\n")
        sys.exit(2)


def check_seed(value: int | None, flag: str = "--seed") -> None:
    """Refuse a seed outside [0, 2**32), which numpy rejects with a traceback only once training starts."""
    if value is not None and value not in SEED_RANGE:
        raise ValueError(f"{flag} must be in [0, {SEED_RANGE.stop - 1}], got {value}.")


def json_object(text: str, flag: str) -> dict[str, Any]:
    """A command-line value that must be a JSON object; a ValueError names the flag and shows one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag} is not JSON ({error.msg}): give an object, e.g. '{{\"key\": 1}}'.") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got a JSON {type(value).__name__}.")
    return value


def _argument_values(argument: object) -> list[tuple[str, object]]:
    """(name, value) of a dataclass's init fields or of a namespace's attributes."""
    if is_dataclass(argument) and not isinstance(argument, type):
        return [(item.name, getattr(argument, item.name)) for item in fields(argument) if item.init]
    return list(vars(argument).items())


EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, as shells report a process that SIGTERM ended
# How the devices word an allocation failure: CUDA and HPU raise RuntimeErrors, the CPU allocator too (RLIMIT_AS).
_OUT_OF_MEMORY_WORDS = (
    "out of memory",
    "can't allocate memory",
    "cannot allocate memory",
    "allocation failed",
    "failed to allocate",
)
GB = 1024**3
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread where it is running, so that a script stops as on Ctrl-C (see
    `exit_on_interrupt_or_oom(sigterm=True)`): its `finally` blocks and clean-up run instead of an abrupt end."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` says that a device (or the host) ran out of memory."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(words in str(error).lower() for words in _OUT_OF_MEMORY_WORDS)


@contextlib.contextmanager
def exit_on_interrupt_or_oom(
    prog: str,
    *,
    on_interrupt: Callable[[], str],
    on_out_of_memory: Callable[[BaseException], str],
    cleanup: Callable[[], None] | None = None,
    sigterm: bool = False,
) -> Iterator[None]:
    """Turn Ctrl-C into `prog: interrupted: <on_interrupt()>` and exit 130, and running out of memory into
    `prog: error: <on_out_of_memory(error)>` and exit 1; `cleanup` runs first (removing partial files). While the
    clean-up and the line run, a second Ctrl-C (or a SIGTERM) is ignored, so that both finish. With `sigterm`,
    SIGTERM stops the block as Ctrl-C does (`Terminated`), with `prog: terminated (SIGTERM): ...` and exit 143.
    Any other exception passes through unchanged.
    """
    previous = _raise_on_sigterm() if sigterm else None
    try:
        yield
    except KeyboardInterrupt as interrupt:
        terminated = isinstance(interrupt, Terminated)
        with _stop_signals_ignored():
            if cleanup is not None:
                cleanup()
            line = f"{prog}: {'terminated (SIGTERM)' if terminated else 'interrupted'}: {on_interrupt()}"
            _write_line(line)
        raise SystemExit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED) from None
    except (MemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        error.__traceback__ = None  # let the tensors of the failed step go before cleaning up
        with _stop_signals_ignored():
            if cleanup is not None:
                cleanup()
            _write_line(f"{prog}: error: {on_out_of_memory(error)}")
        raise SystemExit(EXIT_FAILURE) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends, then act as they would have: what the block writes (a pair of
    result files, say) is written whole. Outside the main thread, where signals cannot be handled, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {
        number: signal.signal(number, lambda number, frame: received.append(number)) for number in _STOP_SIGNALS
    }
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if received:
        signal.raise_signal(received[0])


def _raise_on_sigterm() -> Any:
    """Install a SIGTERM handler that raises `Terminated`; returns the handler it replaced (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminate(number: int, frame: Any) -> None:
        raise Terminated()

    return signal.signal(signal.SIGTERM, terminate)


@contextlib.contextmanager
def _stop_signals_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, signal.SIG_IGN) for number in _STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _write_line(line: str) -> None:
    sys.stderr.write(line.replace("\n", " ") + "\n")
    sys.stderr.flush()


def missing_extra(prog: str, error: ImportError, module: str, what: str, extra: str) -> str:
    """The one line for a script whose optional dependency (a package extra) is missing or cannot be imported."""
    install = f"pip install 'optimum-gaudi-flash[{extra}]' (make install includes it)"
    if (error.name or "").split(".")[0] == module:
        return f"{prog}: error: {what} is not installed; it is the `{extra}` extra: {install}."
    return f"{prog}: error: {what} cannot be imported ({error}): reinstall the `{extra}` extra: {install}."


def hardware() -> dict[str, Any]:
    """The machine a result was measured on, for the result files."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = meminfo_bytes("MemTotal")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": None if memory is None else round(memory / GB, 1),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def meminfo_bytes(field_name: str) -> int | None:
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith(f"{field_name}:"):
            return int(line.split()[1]) * 1024
    return None


# Staging folders of a run's final files, inside its output folder (see `optimum.habana.utils.staging`).
STAGING_PREFIX = ".staging-"


class OutputDirError(ValueError):
    """An output folder or checkpoint that cannot be used as asked; the message names the flag and what to do."""


def prepare_output_dir(output_dir: str, *, overwrite: bool, resuming: bool, can_resume: bool = True) -> Path:
    """Create `output_dir` if needed and check that it can be written and may be written to.

    A folder that holds anything (other than staging folders of killed runs) is refused unless the user said
    `--overwrite_output_dir` or `--resume_from_checkpoint`: an earlier run's adapter is never replaced silently.
    `can_resume`: whether the script has `--resume_from_checkpoint` to offer.
    """
    path = writable_folder(output_dir)
    for stale in remove_stale_staging(path, STAGING_PREFIX):
        logger.info("Removed %s, left by a killed run.", stale)
    refuse_earlier_run(path, output_dir, overwrite=overwrite, resuming=resuming, can_resume=can_resume)
    return path


def check_output_dir(output_dir: str, *, overwrite: bool, resuming: bool, can_resume: bool = True) -> None:
    """What `prepare_output_dir` refuses, told without creating or writing anything (`--explain`)."""
    path = Path(output_dir).expanduser()
    refuse_a_file(path, output_dir)
    existing = next(folder for folder in (path, *path.parents) if folder.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise OutputDirError(
            f"--output_dir {output_dir!r} cannot be written ({existing} is not a folder you can write to); pass a "
            "folder you can write to."
        )
    if path.is_dir():
        refuse_earlier_run(path, output_dir, overwrite=overwrite, resuming=resuming, can_resume=can_resume)


def refuse_earlier_run(path: Path, output_dir: str, *, overwrite: bool, resuming: bool, can_resume: bool) -> None:
    contents = sorted(entry.name for entry in path.iterdir() if not entry.name.startswith(STAGING_PREFIX))
    if contents and not (overwrite or resuming):
        listed = ", ".join(contents[:5]) + (f" and {len(contents) - 5} more" if len(contents) > 5 else "")
        resume = " --resume_from_checkpoint True to continue from its last checkpoint," if can_resume else ""
        raise OutputDirError(
            f"--output_dir {output_dir!r} is not empty ({listed}): refusing to overwrite an earlier run. Pass "
            f"--overwrite_output_dir to replace its files,{resume} or another --output_dir."
        )


def refuse_a_file(path: Path, output_dir: str, flag: str = "--output_dir") -> None:
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"{flag} {output_dir!r} is a file, not a folder; pass a folder.")


def writable_folder(output_dir: str, flag: str = "--output_dir") -> Path:
    """Create the folder if needed and prove it can be written (a temporary file), before any work goes into it."""
    path = Path(output_dir).expanduser()
    refuse_a_file(path, output_dir, flag)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise OutputDirError(
            f"{flag} {output_dir!r} cannot be written ({error.strerror or error}); pass a folder you can write to."
        ) from None
    return path


def environment_versions() -> dict[str, str]:
    """The versions a result was measured with, for the result files."""
    return {
        "optimum-gaudi-flash": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
