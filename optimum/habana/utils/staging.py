"""Staging folders: where a folder's worth of files is written before it is renamed or moved into place.

A staging folder's name says which process made it (host and pid), so that a later run can remove the ones left
by killed processes without touching one that a process running now is still writing: that is what keeps two
runs that share a folder (the model cache, most often) safe from each other.
"""

import contextlib
import os
import secrets
import shutil
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any


STAGING_SUFFIX = ".tmp"


def make_staging_folder(parent: Path, prefix: str) -> Path:
    """A new empty folder `<prefix><host>~<pid>~<random>.tmp` in `parent`, with the umask's permissions.

    Unlike `tempfile.mkdtemp` (always 0700), the folder gets the permissions of any folder the user creates, so
    renaming it into a shared cache leaves it readable where the umask allows.
    """
    folder = staging_path(parent, prefix)
    folder.mkdir()
    return folder


def staging_path(parent: Path, prefix: str) -> Path:
    """A new name `<prefix><host>~<pid>~<random>.tmp` in `parent`, for a file or folder this process writes:
    `remove_stale_staging` removes it once this process is gone."""
    return parent / f"{prefix}{_host()}~{os.getpid()}~{secrets.token_hex(4)}{STAGING_SUFFIX}"


def remove_entry(path: Path) -> None:
    """Remove a folder with what it holds, or a file; errors ignored (cleaning up must never stop a run). A folder
    made read-only inside is made writable by its owner first: its files could not be unlinked otherwise."""
    if path.is_dir() and not path.is_symlink():
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=_writable_then_again)
        else:
            shutil.rmtree(path, onerror=_writable_then_again)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _writable_then_again(function: Any, name: str, _error: Any) -> None:
    """rmtree's error handler: give the failed path's parent folder (and a folder itself) its owner's write and
    search permission, then try once more; a second failure is ignored."""
    with contextlib.suppress(OSError):
        for folder in {os.path.dirname(name), name if os.path.isdir(name) else None} - {None}:
            os.chmod(folder, stat.S_IMODE(os.lstat(folder).st_mode) | stat.S_IRWXU)
        function(name)


def remove_stale_staging(parent: Path, prefix: str, legacy_max_age_s: float | None = None) -> list[Path]:
    """Remove the staging folders (and files) in `parent` whose process is gone; returns what was removed.

    A folder made on this host by a process that no longer exists is stale. A folder from another host is left
    alone (its process cannot be checked from here). Folders named `<prefix>...tmp` without host and pid (made
    by older versions) are stale once older than `legacy_max_age_s`, when given. Errors (a read-only folder, a
    folder another process removes first) are ignored: cleaning up must never stop a run.
    """
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not (entry.name.startswith(prefix) and entry.name.endswith(STAGING_SUFFIX)):
            continue
        if _is_stale(entry, entry.name[len(prefix) : -len(STAGING_SUFFIX)], legacy_max_age_s):
            remove_entry(entry)
            if not entry.exists():
                removed.append(entry)
    return removed


def _is_stale(entry: Path, owner: str, legacy_max_age_s: float | None) -> bool:
    parts = owner.split("~")
    if len(parts) == 3 and parts[1].isdigit():
        host, pid = parts[0], int(parts[1])
        return host == _host() and not _process_exists(pid)
    if legacy_max_age_s is None:
        return False
    try:
        return time.time() - entry.stat().st_mtime > legacy_max_age_s
    except OSError:
        return False


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:
        return True  # cannot tell: keep the folder
    return True


def _host() -> str:
    """The host name, without the characters the staging name uses as separators."""
    with contextlib.suppress(OSError):
        return socket.gethostname().replace("~", "-").replace(os.sep, "-") or "localhost"
    return "localhost"


__all__ = ["STAGING_SUFFIX", "make_staging_folder", "remove_entry", "remove_stale_staging", "staging_path"]
