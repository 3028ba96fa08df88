"""Out of memory and Ctrl-C in the example scripts: one line on stderr and an exit status, never a traceback.

`exit_on_interrupt_or_oom` wraps the part of a script that loads, trains or generates. The script says what to
report (the phase, the batch and lengths that ran out of memory, what was kept) and what to clean up (partial
files); the exit status is 130 for Ctrl-C, as shells use for SIGINT, and 1 for out of memory.
"""

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import torch


EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130
# How the devices word an allocation failure: CUDA and HPU raise RuntimeErrors, the CPU allocator too.
_OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory", "allocation failed", "failed to allocate")


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
) -> Iterator[None]:
    """Turn Ctrl-C into `prog: interrupted: <on_interrupt()>` and exit 130, and running out of memory into
    `prog: error: <on_out_of_memory(error)>` and exit 1; `cleanup` runs first (removing partial files), with a
    second Ctrl-C ignored so that it finishes. Any other exception passes through unchanged.
    """
    try:
        yield
    except KeyboardInterrupt:
        _clean(cleanup)
        _exit(EXIT_INTERRUPTED, f"{prog}: interrupted: {on_interrupt()}")
    except (MemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        error.__traceback__ = None  # let the tensors of the failed step go before cleaning up
        _clean(cleanup)
        _exit(EXIT_FAILURE, f"{prog}: error: {on_out_of_memory(error)}")


def _clean(cleanup: Callable[[], None] | None) -> None:
    if cleanup is None:
        return
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        cleanup()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _exit(status: int, line: str) -> None:
    sys.stderr.write(line.replace("\n", " ") + "\n")
    sys.stderr.flush()
    raise SystemExit(status)


__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "exit_on_interrupt_or_oom", "is_out_of_memory"]
