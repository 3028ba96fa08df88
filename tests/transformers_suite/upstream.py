"""transformers' own model tests, as its release on PyPI ships them.

The transformers wheel has no tests; its source distribution has the top-level ones, `test_modeling_common.py`
(`ModelTesterMixin`, ~170 tests every model of the library passes) among them, but neither the generation tests it
imports nor the per-family tester classes. `model_tester_mixin()` downloads the source distribution of the
installed version once per machine (10 MB, from PyPI, cached in the user's cache folder), unpacks its top-level
tests as the package `transformers_model_tests`, and fills the two modules it lacks with this project's own
(`tests/transformers_suite/generation.py` for the generation tests; exporting is not tested here).
"""

import importlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

import platformdirs
import transformers
from filelock import FileLock


PACKAGE = "transformers_model_tests"
CACHE = Path(platformdirs.user_cache_dir("optimum-gaudi-flash")) / f"transformers-{transformers.__version__}-tests"
STAND_INS = {
    "generation/test_utils.py": "from tests.transformers_suite.generation import GenerationTesterMixin  # noqa: F401\n",
    "exporters/test_export.py": (
        'class ExportTesterMixin:\n    """Not run here: exporting is not what the Gaudi classes change."""\n'
    ),
}


def model_tester_mixin() -> ModuleType:
    """`transformers_model_tests.test_modeling_common`, unpacked on first use."""
    package = CACHE / PACKAGE
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / ".lock")):
        if not (package / "test_modeling_common.py").is_file():
            _unpack(package)
    if str(CACHE) not in sys.path:
        sys.path.insert(0, str(CACHE))
    return importlib.import_module(f"{PACKAGE}.test_modeling_common")


def _unpack(package: Path) -> None:
    version = transformers.__version__
    with tempfile.TemporaryDirectory(dir=CACHE) as staging:  # the same file system: the rename below is atomic
        staging = Path(staging)
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        done = subprocess.run(
            [*command, f"transformers=={version}", "-d", str(staging)], capture_output=True, text=True
        )
        archives = list(staging.glob("transformers-*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise RuntimeError(
                f"transformers' model tests need its source distribution from PyPI (transformers=={version}), "
                f"which could not be downloaded: {(done.stderr.strip().splitlines() or ['no archive'])[-1]}"
            )
        unpacked = staging / PACKAGE
        unpacked.mkdir()
        with tarfile.open(archives[0]) as archive:
            for member in archive.getmembers():
                parts = Path(member.name).parts
                if len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py") and member.isfile():
                    (unpacked / parts[2]).write_bytes(archive.extractfile(member).read())
        (unpacked / "__init__.py").write_text("")
        for relative, text in STAND_INS.items():
            path = unpacked / relative
            path.parent.mkdir(exist_ok=True)
            (path.parent / "__init__.py").touch()
            path.write_text(text)
        shutil.rmtree(package, ignore_errors=True)  # a partial one of an older layout
        unpacked.rename(package)
