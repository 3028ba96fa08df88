"""What `import optimum.habana` needs of its environment, checked first, before transformers is imported.

A transformers outside the tested range fails somewhere inside this package's extensions of it, far from the cause.
The likeliest way to get one is Optimum-Habana in the same environment: it installs the same import path,
`optimum.habana`, and pins transformers below 4.56; the two packages cannot share an environment. Only package
metadata is read here, so the check costs no import.
"""

import warnings
from importlib import metadata

from packaging.specifiers import SpecifierSet

from optimum.habana.version import TRANSFORMERS_REQUIREMENT, __version__


REPLACE_OPTIMUM_HABANA = (
    "pip uninstall optimum-habana optimum-gaudi-flash, then pip install optimum-gaudi-flash (both install "
    "optimum/habana, so removing one removes files of the other)"
)


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def transformers_problem() -> str | None:
    """The one line that says the installed transformers is outside TRANSFORMERS_REQUIREMENT, and what to do; None
    when it is inside."""
    installed = installed_version("transformers")
    required = f"transformers{TRANSFORMERS_REQUIREMENT}"
    if installed is not None and SpecifierSet(TRANSFORMERS_REQUIREMENT).contains(installed, prereleases=True):
        return None
    found = "transformers is not installed" if installed is None else f"transformers {installed} is installed"
    line = f"optimum.habana (optimum-gaudi-flash {__version__}) needs {required}, but {found}"
    optimum_habana = installed_version("optimum-habana")
    if optimum_habana is None:
        return f"{line}: pip install '{required}'."
    return (
        f"{line}, most likely for Optimum-Habana {optimum_habana}, installed in the same environment (it pins "
        f"transformers below 4.56 and uses the same import path): {REPLACE_OPTIMUM_HABANA}."
    )


def check_environment() -> None:
    """Raise ImportError for a transformers outside the tested range; warn (once) when Optimum-Habana is installed
    beside this package with a transformers that fits."""
    if problem := transformers_problem():
        raise ImportError(problem)
    if (optimum_habana := installed_version("optimum-habana")) is not None:
        warnings.warn(
            f"Optimum-Habana {optimum_habana} is installed beside optimum-gaudi-flash {__version__}: both install "
            f"optimum.habana, which now holds a mix of their files. Keep one: {REPLACE_OPTIMUM_HABANA}.",
            stacklevel=3,
        )
