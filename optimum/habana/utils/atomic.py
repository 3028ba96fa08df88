"""Atomic file writes: a reader, or a run killed half-way, sees the old file or the new one, never a mix.

The data goes to a temporary file in the destination's own folder (a rename is atomic only within one file
system), is flushed to disk, and then replaces the destination with `os.replace`. A destination that is a symbolic
link is replaced by the new file: the link's target, which may be someone else's file, is never written through.
The new file gets the permissions the user's umask gives, like any file `open(path, "w")` creates.
"""

import contextlib
import errno
import itertools
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike, data: bytes, replace: bool = True) -> Path:
    """Write `data` to `path` atomically; returns the path written. Without `replace`, a file that is at `path` when
    the new one would take its place (one that appeared since the caller checked) stays, and FileExistsError says so."""
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o666 & ~current_umask())  # mkstemp creates 0600
        if replace:
            os.replace(temporary, path)
        else:
            _put_in_place_unless_taken(temporary, path)
    except BaseException:  # KeyboardInterrupt included: never leave the temporary file behind
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_folder(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8", replace: bool = True) -> Path:
    """Write `text` to `path` atomically; returns the path written (`replace`: as for `atomic_write_bytes`)."""
    return atomic_write_bytes(path, text.encode(encoding), replace)


def atomic_write_text_beside(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` atomically, or, where a file is there when it would take its place (another run's,
    that appeared since the caller checked), to the first free name beside it (`results-1.json`, ...); returns the
    path written, so that the caller can say where its results went."""
    path = Path(path)
    for attempt in itertools.count():
        candidate = path if attempt == 0 else path.with_name(f"{path.stem}-{attempt}{path.suffix}")
        try:
            return atomic_write_text(candidate, text, encoding, replace=False)
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def _put_in_place_unless_taken(temporary: str, path: Path) -> None:
    """A hard link fails on an existing name, atomically; a file system without hard links gets a check, then the
    rename."""
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise
    except OSError:
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
        os.replace(temporary, path)
        return
    os.unlink(temporary)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux tells it (/proc), else set and restored."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable; some file systems (and all of Windows) cannot open a folder: skip there."""
    with contextlib.suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_text_beside", "current_umask"]
