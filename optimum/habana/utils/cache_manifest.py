"""The manifest of a converted checkpoint in the model cache: what the conversion wrote, checked on every load.

The manifest (`.complete`, JSON, written last) lists every file of the checkpoint with its size and sha256, and the
file's stat stamp (inode, size, modification and change times) when it was hashed. Verification checks that every
file is there with its size, and re-hashes a file only when its stamp changed: any write, truncation, copy or
`touch` changes the change time (ctime), which no user call can set back. An untouched entry thus costs a few stat
calls, and a modified one a full hash (~0.4 s for the 540 MB of the default model, against ~0.5-1 s for loading
it); docs/model_cache.md has the measurements.
"""

import contextlib
import hashlib
import json
import os
from pathlib import Path

from .atomic import atomic_write_text


MANIFEST_NAME = ".complete"
FORMAT_VERSION = 1
# verify()'s answer for a folder that does not exist: nothing to report, just convert.
ABSENT = "absent"
_HASH_CHUNK_BYTES = 1 << 22


def write(folder: Path, source: str) -> None:
    """Hash every file of `folder` and write the manifest; call it once everything else is written."""
    files = {}
    for path in _checkpoint_files(folder):
        files[path.relative_to(folder).as_posix()] = {
            "size": path.stat().st_size,
            "sha256": file_sha256(path),
            "stamp": _stamp(path),
        }
    manifest = {"format": FORMAT_VERSION, "source": source, "files": files}
    atomic_write_text(folder / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def verify(folder: Path) -> str | None:
    """None when `folder` holds exactly what its manifest says; else what is wrong, in a few words (or ABSENT)."""
    if not folder.is_dir():
        return ABSENT
    manifest_path = folder / MANIFEST_NAME
    try:
        text = manifest_path.read_text()
    except FileNotFoundError:
        return f"no {MANIFEST_NAME} manifest: the conversion that wrote it did not finish"
    except (OSError, UnicodeDecodeError) as error:
        return f"its manifest {MANIFEST_NAME} cannot be read ({error})"
    try:
        manifest = json.loads(text)
        files = manifest["files"]
        if manifest.get("format") != FORMAT_VERSION or not isinstance(files, dict):
            raise ValueError("unknown format")
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"its manifest {MANIFEST_NAME} is from an older version or damaged (no file sizes and hashes)"
    if "config.json" not in files:
        return "its manifest lists no config.json"
    # A file the conversion did not write changes what loads (an adapter saved there, a tokenizer file).
    written = {path.relative_to(folder).as_posix() for path in _checkpoint_files(folder) if not _is_temporary(path)}
    if added := sorted(written - set(files)):
        more = f" and {len(added) - 1} more" if len(added) > 1 else ""
        return f"it holds {added[0]}{more}, which the conversion did not write"

    restamped = False
    for name, record in files.items():
        if not _well_formed(name, record):  # valid JSON, but not what write() writes: converted again, not a crash
            return f"its manifest {MANIFEST_NAME} is damaged (its record of {name!r} is not a size and a hash)"
        path = folder / name
        try:
            stamp = _stamp(path)
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as error:
            return f"{name} cannot be read ({error.strerror})"
        if stamp["size"] != record["size"]:
            return f"{name} is {stamp['size']} bytes, {record['size']} expected"
        if stamp == record.get("stamp"):
            continue
        try:
            digest = file_sha256(path)
        except OSError as error:
            return f"{name} cannot be read ({error.strerror})"
        if digest != record["sha256"]:
            return f"the content of {name} differs from the one converted (sha256 mismatch)"
        record["stamp"] = stamp  # same content, new stamp (copied or restored): remember it, hash once
        restamped = True
    if restamped:
        with contextlib.suppress(OSError):  # a read-only cache: verified anyway, hashed again next time
            atomic_write_text(manifest_path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return None


def _well_formed(name: str, record: object) -> bool:
    """A record as write() makes it: a relative path inside the folder, a size and a sha256."""
    return (
        not Path(name).is_absolute()
        and ".." not in Path(name).parts
        and isinstance(record, dict)
        and isinstance(record.get("size"), int)
        and isinstance(record.get("sha256"), str)
    )


def file_sha256(path: Path) -> str:
    """The file's sha256, read in chunks so that large files do not have to fit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _checkpoint_files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file() and path.name != MANIFEST_NAME)


def _is_temporary(path: Path) -> bool:
    """A file `atomic_write_text` is writing (another process restamping the manifest): `.<name>.<random>.tmp`."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def _stamp(path: Path) -> dict[str, int]:
    """What changes whenever the file's content may have: any write, truncation, copy or touch moves ctime."""
    status = os.stat(path)
    return {
        "inode": status.st_ino,
        "size": status.st_size,
        "mtime_ns": status.st_mtime_ns,
        "ctime_ns": status.st_ctime_ns,
    }


__all__ = ["ABSENT", "MANIFEST_NAME", "file_sha256", "verify", "write"]
