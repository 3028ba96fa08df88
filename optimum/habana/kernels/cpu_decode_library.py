"""The CPU decode kernel's shared library: compiled from `cpu_decode.c` once per source, flags, compiler, OpenMP
runtime and CPU into the library's cache folder, and trusted only as far as it is checked.

A library is written atomically, readable by every user of a shared cache folder, with a record beside it (the
SHA-256 of the bytes the build wrote): a file whose bytes differ from its record (cut short, overwritten, a build
of another key) is never handed to `dlopen`, whose reading of a damaged library can kill the process (SIGBUS), but
built again. A library that loads is then checked against PyTorch's attention on a small input (`cpu_decode.py`):
one that disagrees is built again once, and only then left off for the process, with one warning. Where the cache
folder cannot be written, the library is built into a temporary folder for this process alone, and that folder is
removed as soon as the library is loaded.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..utils.atomic import atomic_write_text
from ..utils.cache_folder import cache_root
from ..utils.staging import remove_stale_staging, staging_path


SOURCE = Path(__file__).with_name("cpu_decode.c")
# A library being compiled, named after its process: a build killed midway leaves it for a later build to remove.
BUILD_PREFIX = ".build-"
# Vectorisation without -ffast-math's assumption that nothing is infinite (masked scores are -inf).
FLAGS = (
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
    "-fopenmp", "-shared", "-fPIC",
)  # fmt: skip
# The fields of /proc/cpuinfo that name the CPU and its instructions: x86's, and ARM's (aarch64 has no "flags").
CPU_FIELDS = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part")


def load_library(
    head_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    dtype_flag: str,
    agrees: Callable[[ctypes.CDLL, int, int, torch.dtype], bool],
) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None), or (None, why no good one can be had here). `agrees(library, head_dim, value_dim, dtype)`
    is the check against the attention's own arithmetic that a loaded library must pass."""
    problem = environment_problem()
    if problem is not None:
        return None, problem
    for attempt in ("cached", "rebuilt"):
        try:
            path, temporary = built_library(head_dim, value_dim, dtype, dtype_flag, rebuild=attempt == "rebuilt")
        except (OSError, subprocess.CalledProcessError) as error:
            details = (getattr(error, "stderr", "") or str(error)).strip().splitlines() or ["no output"]
            # the linker's own reason (a full disk...), not GCC's "collect2: error: ld returned 1 exit status" after it
            reason = next((line for line in reversed(details) if not line.startswith("collect2:")), details[-1])
            return None, f"building it for {dtype} heads of {head_dim} failed: {reason}"
        try:
            library = _declared(ctypes.CDLL(str(path)))
        except (OSError, AttributeError) as error:
            problem = f"its library for {dtype} heads of {head_dim} does not load: {error}"
            continue
        finally:
            if temporary:
                shutil.rmtree(path.parent, ignore_errors=True)  # loaded (or not): nothing left behind
        if agrees(library, head_dim, value_dim, dtype):
            return library, None
        problem = (
            f"its library for {dtype} heads of {head_dim}, built here, gives other results than PyTorch's attention "
            "on a small input"
        )
    return None, problem


def _declared(library: ctypes.CDLL) -> ctypes.CDLL:
    integer, pointer = ctypes.c_int64, ctypes.c_void_p
    dense, paged = library.decode_attention, library.paged_decode_attention
    dense.argtypes = [
        pointer, integer, integer, integer,
        pointer, integer, integer, integer,
        pointer, integer, integer, integer,
        pointer, pointer, integer, integer, integer, integer, pointer, integer, integer, integer,
        pointer, integer, integer, integer, integer, ctypes.c_float, integer, ctypes.c_int,
    ]  # fmt: skip
    paged.argtypes = [
        pointer, integer, integer,
        pointer, integer, integer, pointer, integer, integer,
        integer, pointer, pointer, pointer, pointer,
        pointer, integer, integer, integer, ctypes.c_float, integer, ctypes.c_int,
    ]  # fmt: skip
    dense.restype = paged.restype = ctypes.c_int
    return library


@functools.cache
def environment_problem() -> str | None:
    """Why no kernel can be built in this process, or None."""
    if compiler() is None:
        return "no C compiler: install gcc, or name one in CC"
    if openmp_library() is None:
        return "PyTorch here does not run on GNU OpenMP (libgomp), whose threads the kernel shares"
    return None


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.cache
def openmp_library() -> Path | None:
    """The `libgomp` this process has loaded (PyTorch's own copy, in pip's builds)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1]
        if "/libgomp" in path and ".so" in path:
            return Path(path)
    return None


def built_library(
    head_dim: int, value_dim: int, dtype: torch.dtype, dtype_flag: str, rebuild: bool = False
) -> tuple[Path, bool]:
    """(the library's path, whether it lies in a temporary folder of this process). A cached library is used where
    its bytes match its record; otherwise (or with `rebuild`) it is compiled again."""
    cc, openmp = compiler(), openmp_library()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    fingerprint = hashlib.sha256(SOURCE.read_bytes())
    flags = [*FLAGS, f"-DHEAD_DIM={head_dim}", f"-DVALUE_DIM={value_dim}", dtype_flag]
    for part in (*flags, cc, version, str(openmp), cpu_identity()):
        fingerprint.update(part.encode())
    values = "" if value_dim == head_dim else f"_v{value_dim}"
    name = f"cpu_decode_{str(dtype).removeprefix('torch.')}_d{head_dim}{values}_{fingerprint.hexdigest()[:16]}.so"
    folder = cache_root() / "kernels"
    if not rebuild and _matches_record(folder / name):
        return folder / name, False
    temporary = False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(folder, BUILD_PREFIX)  # what builds killed midway (kill -9) left
        building = str(staging_path(folder, BUILD_PREFIX))
        os.close(os.open(building, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except OSError:
        folder, temporary = Path(tempfile.mkdtemp(prefix="optimum-habana-kernels-")), True
        building = str(staging_path(folder, BUILD_PREFIX))
    command = [cc, *filter(None, flags), str(SOURCE), "-o", building]
    command += [str(openmp), f"-Wl,-rpath,{openmp.parent}", "-lm"]
    try:
        subprocess.run(command, capture_output=True, text=True, check=True)
        os.chmod(building, 0o755)  # readable by every user of a shared cache folder
        digest = hashlib.sha256(Path(building).read_bytes()).hexdigest()
        os.replace(building, folder / name)
        atomic_write_text(_record(folder / name), digest)
    except BaseException:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        if os.path.exists(building):
            os.unlink(building)
    return folder / name, temporary


def _record(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _matches_record(library: Path) -> bool:
    try:
        return hashlib.sha256(library.read_bytes()).hexdigest() == _record(library).read_text().strip()
    except OSError:
        return False


def cpu_identity() -> str:
    """The CPU's model and instruction sets, on x86 and ARM alike: a library built with -march=native on another CPU
    (a cache folder shared between machines) may use instructions this one lacks."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    fields = [next((line for line in lines if line.split(":")[0].strip() == field), "") for field in CPU_FIELDS]
    return "\n".join([platform.machine(), *fields])


__all__ = ["FLAGS", "SOURCE", "built_library", "compiler", "cpu_identity", "environment_problem", "load_library"]
