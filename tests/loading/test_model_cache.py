"""The model cache verifies itself: damaged entries are reported and rebuilt, killed conversions leave nothing
behind, an unusable cache location falls back to a private conversion, permissions follow the umask.

Conversions are faked (a config.json and 64 KiB of weights) so that each case runs in milliseconds; the real
conversion is covered by tests/test_model_loading.py. Subprocesses only where a signal is the point.
"""

import errno
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import transformers

from optimum.habana.utils import cache_manifest, model_loading
from optimum.habana.utils.model_loading import CACHE_ENV_VAR, ModelResolutionError, resolve_model
from optimum.habana.utils.staging import make_staging_folder, remove_entry, staging_path
from tests.helpers import ROOT, write_gguf


DRIVER = ROOT / "tests" / "fault_driver.py"
WEIGHTS = "model.safetensors"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV_VAR, str(root))
    monkeypatch.setattr(model_loading, "_PRIVATE_CONVERSIONS", {})  # another test's private conversions
    return root


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """Fake conversions, recorded: each writes a config.json and random weights."""
    calls = []

    def convert(gguf_path: Path, output_dir: Path) -> None:
        calls.append(output_dir)
        (output_dir / "config.json").write_text('{"model_type": "llama"}')
        (output_dir / WEIGHTS).write_bytes(os.urandom(1 << 16))

    monkeypatch.setattr(model_loading, "_convert_gguf", convert)
    return calls


@pytest.fixture
def gguf_file(tmp_path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf", arch="llama")


def entries(cache: Path) -> list[str]:
    """What the cache's GGUF folder holds, but the lock files its entries keep beside them (one each, by design)."""
    return sorted(path.name for path in (cache / "gguf").iterdir() if not path.name.endswith(".lock"))


def staging_left(cache: Path) -> list[Path]:
    return [entry for entry in (cache / "gguf").iterdir() if entry.name.endswith(".tmp")]


# --- verification on load ----------------------------------------------------------------------------------------


def test_manifest_records_sizes_and_hashes_and_an_untouched_entry_is_not_rehashed(
    cache, conversions, gguf_file, monkeypatch
):
    entry = resolve_model(str(gguf_file)).path
    files = json.loads((entry / cache_manifest.MANIFEST_NAME).read_text())["files"]
    assert files[WEIGHTS]["size"] == 1 << 16
    assert files[WEIGHTS]["sha256"] == cache_manifest.file_sha256(entry / WEIGHTS)
    assert set(files) == {"config.json", WEIGHTS}

    hashed = spy_on_hashing(monkeypatch, entry)
    again = resolve_model(str(gguf_file))
    assert again.path == entry and again.converted is False
    assert hashed == [], "an untouched entry is verified by its stat stamps, without reading the weights"


def spy_on_hashing(monkeypatch, entry: Path) -> list[Path]:
    """The files of `entry` hashed from now on (the GGUF file itself is always hashed: it is the cache key)."""
    hashed, real = [], cache_manifest.file_sha256

    def spy(path: Path) -> str:
        if Path(path).parent == entry:
            hashed.append(path)
        return real(path)

    monkeypatch.setattr(cache_manifest, "file_sha256", spy)
    return hashed


def damage_truncate(entry: Path) -> None:
    with open(entry / WEIGHTS, "r+b") as file:
        file.truncate(1000)


def damage_zero(entry: Path) -> None:
    """Same size, zeroed bytes, and the modification time put back: only the content hash can tell."""
    status = os.stat(entry / WEIGHTS)
    with open(entry / WEIGHTS, "r+b") as file:
        file.seek(4096)
        file.write(bytes(4096))
    os.utime(entry / WEIGHTS, ns=(status.st_atime_ns, status.st_mtime_ns))


def damage_delete_weights(entry: Path) -> None:
    (entry / WEIGHTS).unlink()


def damage_delete_manifest(entry: Path) -> None:
    (entry / cache_manifest.MANIFEST_NAME).unlink()


def damage_junk_manifest(entry: Path) -> None:
    (entry / cache_manifest.MANIFEST_NAME).write_text("not json")


def damage_legacy_manifest(entry: Path) -> None:
    """What versions before the manifest wrote: no sizes, no hashes."""
    (entry / cache_manifest.MANIFEST_NAME).write_text("0123abcd  tiny.gguf\n")


def damage_add_adapter(entry: Path) -> None:
    """An adapter saved into the entry: from_pretrained would apply it to every later load of the model."""
    (entry / "adapter_config.json").write_text("{}")
    (entry / "adapter_model.safetensors").write_bytes(b"lora")


def damaged_records(*records):
    """Valid JSON, records unlike write()'s: an empty one, a list, one without a hash, a path out of the folder."""

    def damage(entry: Path) -> None:
        path = entry / cache_manifest.MANIFEST_NAME
        manifest = json.loads(path.read_text())
        manifest["files"] |= dict(records)
        path.write_text(json.dumps(manifest))

    return damage


@pytest.mark.parametrize(
    "damage, words",
    [
        (damage_truncate, [WEIGHTS, "1000 bytes", "65536 expected"]),
        (damage_zero, [WEIGHTS, "sha256 mismatch"]),
        (damage_delete_weights, [WEIGHTS, "missing"]),
        (damage_delete_manifest, ["no .complete manifest"]),
        (damage_add_adapter, ["it holds adapter_config.json and 1 more, which the conversion did not write"]),
        (damage_junk_manifest, ["older version or damaged"]),
        (damage_legacy_manifest, ["older version or damaged"]),
        (damaged_records(("config.json", {})), ["damaged", "its record of 'config.json'"]),
        (damaged_records(("config.json", [1])), ["damaged", "'config.json'"]),
        (damaged_records(("config.json", {"size": 2})), ["damaged", "'config.json'"]),
        (damaged_records(("../elsewhere", {"size": 2, "sha256": "00"})), ["damaged", "'../elsewhere'"]),
    ],
    ids=[
        "truncated",
        "zeroed",
        "deleted weights",
        "deleted manifest",
        "added adapter",
        "junk manifest",
        "legacy manifest",
        "empty record",
        "list record",
        "record without hash",
        "record out of the folder",
    ],
)
def test_damaged_entry_is_reported_in_one_line_and_rebuilt(cache, conversions, gguf_file, caplog, damage, words):
    entry = resolve_model(str(gguf_file)).path
    damage(entry)
    with caplog.at_level(logging.WARNING, logger=model_loading.__name__):
        rebuilt = resolve_model(str(gguf_file))
    assert rebuilt.path == entry and rebuilt.converted is True and len(conversions) == 2
    (record,) = [record for record in caplog.records if record.levelno >= logging.WARNING]
    message = record.getMessage()
    assert "\n" not in message and str(entry) in message and "converting it again" in message
    for word in words:
        assert word in message
    assert cache_manifest.verify(entry) is None
    assert not staging_left(cache)


def test_touched_but_unchanged_entry_is_hashed_once_then_trusted(cache, conversions, gguf_file, monkeypatch):
    entry = resolve_model(str(gguf_file)).path
    os.utime(entry / WEIGHTS)  # a copy or a backup restore: new stamp, same bytes
    assert resolve_model(str(gguf_file)).converted is False
    hashed = spy_on_hashing(monkeypatch, entry)
    assert resolve_model(str(gguf_file)).converted is False
    assert hashed == [] and len(conversions) == 1


# --- staging folders of killed conversions -----------------------------------------------------------------------


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_staging_is_removed_and_live_staging_kept(cache, conversions, gguf_file, tmp_path):
    folder = cache / "gguf"
    folder.mkdir(parents=True)
    host = make_staging_folder(tmp_path, ".").name[1:].split("~")[0]
    dead = folder / f".{host}~{dead_pid()}~abcd.tmp"
    live = folder / f".{host}~{os.getpid()}~abcd.tmp"  # a conversion in progress in this very process
    other_host = folder / f".elsewhere~{dead_pid()}~abcd.tmp"
    old_legacy, new_legacy = folder / ".0123456789abcdef-x1y2.tmp", folder / ".fedcba9876543210-z3.tmp"
    for staging in (dead, live, other_host, old_legacy, new_legacy):
        staging.mkdir(exist_ok=True)
        (staging / "config.json").write_text("{}")
    day_ago = time.time() - 24 * 3600
    os.utime(old_legacy, (day_ago, day_ago))

    resolve_model(str(gguf_file))

    assert not dead.exists() and not old_legacy.exists()
    assert live.exists() and other_host.exists() and new_legacy.exists()


def run_driver(cache: Path, marker: Path, *args: str, fast: bool = False) -> subprocess.Popen:
    env = {**os.environ, CACHE_ENV_VAR: str(cache), "PYTHONPATH": str(ROOT), "FAULT_DRIVER_FAST": "1" if fast else ""}
    return subprocess.Popen(
        [sys.executable, str(DRIVER), *args[:1], str(marker), *args[1:]],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_conversion_killed_then_rerun_converts_and_leaves_nothing_behind(cache, conversions, gguf_file, tmp_path):
    """kill -9 gives no chance to clean up: the next run removes the staging folder. (Ctrl-C cleans up at once:
    tests/test_run_lora_clm_failures.py sends it to the script during a conversion.)"""
    marker = tmp_path / "converting"
    process = run_driver(cache, marker, "resolve", str(gguf_file))
    wait_for(marker, process)
    staging = Path(marker.read_text())
    assert staging.is_dir() and staging.parent == cache / "gguf"
    process.kill()
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert [entry.name for entry in (cache / "gguf").iterdir()] == [staging.name]

    rerun = resolve_model(str(gguf_file))
    assert rerun.converted is True and cache_manifest.verify(rerun.path) is None
    assert entries(cache) == [rerun.path.name]


def test_concurrent_conversions_both_succeed_with_one_entry(cache, gguf_file, tmp_path):
    first = run_driver(cache, tmp_path / "a", "resolve", str(gguf_file), fast=True)
    second = run_driver(cache, tmp_path / "b", "resolve", str(gguf_file), fast=True)
    paths = []
    for process in (first, second):
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
        paths.append(stdout.strip())
    assert paths[0] == paths[1]
    assert cache_manifest.verify(Path(paths[0])) is None
    assert entries(cache) == [Path(paths[0]).name]


# --- unusable cache location, permissions ------------------------------------------------------------------------


def test_unusable_cache_falls_back_to_a_private_conversion_with_one_line(
    tmp_path, monkeypatch, conversions, gguf_file, caplog
):
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    monkeypatch.setenv(CACHE_ENV_VAR, str(blocker))
    temporary = tmp_path / "tmp"  # the system's temporary folder, as far as this run knows
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    # what a private conversion killed by `kill -9` left (500 MB or more with a real model): removed by the next
    ours = staging_path(temporary, model_loading._PRIVATE_PREFIX)
    killed = ours.with_name(ours.name.replace(f"~{os.getpid()}~", f"~{dead_pid()}~"))
    killed.mkdir()
    with caplog.at_level(logging.WARNING, logger=model_loading.__name__):
        resolved = resolve_model(str(gguf_file))
    assert not killed.exists() and resolved.path.parent == temporary
    assert resolved.converted is True and blocker.read_text() == "in the way"
    assert not resolved.path.is_relative_to(blocker) and (resolved.path / "config.json").is_file()
    (record,) = caplog.records
    message = record.getMessage()
    assert "\n" not in message and str(blocker) in message and CACHE_ENV_VAR in message
    assert str(resolved.path) in message


def test_damaged_entry_in_a_read_only_cache_is_converted_privately(cache, conversions, gguf_file, monkeypatch, caplog):
    entry = resolve_model(str(gguf_file)).path
    damage_truncate(entry)

    def read_only(parent, prefix):  # the cache's folder only: the private conversion's temporary one is writable
        if parent.is_relative_to(cache):
            raise PermissionError(13, "Permission denied", str(parent))
        return make_staging_folder(parent, prefix)

    monkeypatch.setattr(model_loading, "make_staging_folder", read_only)
    with caplog.at_level(logging.WARNING, logger=model_loading.__name__):
        resolved = resolve_model(str(gguf_file))
    assert resolved.path != entry and cache_manifest.verify(resolved.path) is None
    # Warnings only: a run_generation.py main() earlier in this process may have set the library's logger to INFO.
    warned = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert [message.count("\n") for message in warned] == [0, 0]
    assert "damaged" in warned[0] and "cannot be written" in warned[1]
    # Resolved again in this process (the server's model and processor, a rank's checks): converted once.
    again = resolve_model(str(gguf_file))
    assert again.path == resolved.path and again.converted is False and len(conversions) == 2


def test_permissions_follow_the_umask(cache, conversions, gguf_file):
    previous = os.umask(0o027)
    try:
        entry = resolve_model(str(gguf_file)).path
    finally:
        os.umask(previous)
    assert entry.stat().st_mode & 0o777 == 0o750
    for path in entry.iterdir():
        assert path.stat().st_mode & 0o777 == 0o640, path


# --- conversions that fail: one line each, nothing left behind ---------------------------------------------------


def test_a_gguf_whose_tensors_contradict_its_metadata_is_one_line(cache, gguf_file):
    """transformers raises a RuntimeError (its size mismatch) for this file's 4 x 8 tensor: reported as the file's
    problem, as other damage is, not as a traceback."""
    with pytest.raises(ModelResolutionError) as refused:
        resolve_model(str(gguf_file))
    message = str(refused.value)
    assert "\n" not in message and "could not be converted (RuntimeError: " in message and "may be damaged" in message
    assert not staging_left(cache) and not [entry for entry in (cache / "gguf").iterdir()]


class Saving:
    """A loaded model or tokenizer whose save fails with `error` as on a full disk (safetensors' SafetensorError,
    tokenizers' bare Exception), or writes a file."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def save_pretrained(self, folder) -> None:
        if self.error is not None:
            raise self.error
        (Path(folder) / "config.json").write_text('{"model_type": "llama"}')


@pytest.mark.parametrize("where", ["weights", "tokenizer", "manifest"])
def test_a_full_disk_during_the_conversion_is_one_line_naming_the_cache(cache, gguf_file, monkeypatch, where):
    full = Exception("No space left on device (os error 28)")
    model, tokenizer = Saving(full if where == "weights" else None), Saving(full if where == "tokenizer" else None)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: tokenizer)
    if where == "manifest":

        def no_room(folder, source):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(cache_manifest, "write", no_room)
    with pytest.raises(ModelResolutionError) as refused:
        resolve_model(str(gguf_file))
    message = str(refused.value)
    assert "\n" not in message and f"could not be written to {cache / 'gguf'}" in message
    assert "No space left on device" in message and CACHE_ENV_VAR in message and "damaged" not in message
    assert not staging_left(cache)


def test_a_good_entry_put_in_place_during_anothers_check_is_never_discarded(
    cache, conversions, gguf_file, monkeypatch
):
    """Two conversions of a damaged entry. While one hashes the damaged entry (a long check: same size, other bytes),
    the other puts its good entry in place and returns it to its caller; the first must not then discard that
    entry under the second's reader, as its stale verdict once made it do: the entry's lock orders the two."""
    entry = resolve_model(str(gguf_file)).path
    damage_zero(entry)
    verify, checks, others, returned = cache_manifest.verify, [], [], {}

    def other_process() -> None:
        staging = make_staging_folder(entry.parent, model_loading._STAGING_PREFIX)
        (staging / "config.json").write_text('{"model_type": "llama"}')
        (staging / WEIGHTS).write_bytes(os.urandom(1 << 16))
        cache_manifest.write(staging, source="the other process")
        try:
            model_loading._move_into_place(staging, entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # as resolve_model does: left where another's won
        returned["inode"] = entry.stat().st_ino  # the entry its caller now loads

    def checked_meanwhile(folder: Path):
        answer = verify(folder)
        checks.append(folder)
        if folder == entry and len(checks) == 2:  # this conversion's check before it discards the damaged entry
            other = threading.Thread(target=other_process)
            others.append(other)
            other.start()
            other.join(timeout=1)  # it finishes now, or waits for this one's lock
        return answer

    monkeypatch.setattr(cache_manifest, "verify", checked_meanwhile)
    resolve_model(str(gguf_file))
    (other,) = others
    other.join(timeout=30)
    assert returned and entry.stat().st_ino == returned["inode"] and verify(entry) is None
    assert not staging_left(cache)


def test_a_discarded_folder_made_read_only_inside_is_removed(tmp_path, monkeypatch):
    """A damaged entry whose own folder is read-only (its parent writable) was left behind for good."""
    folder = tmp_path / "discarded"
    (folder / "inner").mkdir(parents=True)
    (folder / "inner" / "weights").write_bytes(b"x")
    (folder / "config.json").write_text("{}")
    for path in (folder / "inner", folder):
        path.chmod(0o555)
    unlink = os.unlink

    def as_the_kernel_rules(path, *args, **kwargs):  # root may unlink anywhere: refuse as for any other user
        if not os.stat(os.path.dirname(path)).st_mode & stat.S_IWUSR:
            raise PermissionError(13, "Permission denied", path)
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", as_the_kernel_rules)
    remove_entry(folder)
    assert not folder.exists()
