"""Packaging for optimum-gaudi-flash: the `optimum.habana` flash-attention library for transformers' causal LMs."""

import re
from pathlib import Path

from setuptools import find_namespace_packages, setup


ROOT = Path(__file__).parent
VERSION_FILE = (ROOT / "optimum/habana/version.py").read_text()
VERSION = re.search(r'__version__ = "([^"]+)"', VERSION_FILE).group(1)
# The tested transformers range, which `import optimum.habana` checks too (optimum/habana/utils/requirements.py).
TRANSFORMERS = re.search(r'TRANSFORMERS_REQUIREMENT = "([^"]+)"', VERSION_FILE).group(1)

INSTALL_REQUIRES = [
    # 2.5 is the first release whose scaled_dot_product_attention takes `enable_gqa`.
    "torch>=2.5",
    # The attention and mask interfaces and the generate() internals we extend are pinned to the tested range.
    f"transformers{TRANSFORMERS}",
    # The import-time check of that range (transformers depends on it too).
    "packaging>=20",
    "accelerate>=1.0",
    # Model resolution: GGUF files are converted once and cached in the user's cache folder.
    "gguf>=0.10",
    "platformdirs>=4",
]

EXTRAS = {
    # What the scripts in examples/ and their code, `optimum.habana.cli`, need.
    # aiohttp, psutil: examples/serving/load_test.py's clients and the server's resident memory.
    "examples": [
        "datasets>=3",
        "peft>=0.17",
        "tqdm>=4.60",
        "tabulate>=0.9",
        "matplotlib>=3.8",
        "aiohttp>=3.9",
        "psutil>=5.9",
    ],
    # filelock: tests/generation/test_multi_device.py starts its multi-process runs once per session, even under
    # xdist. trl: tests/finetuning/test_trl.py trains with TRL's SFTTrainer (1.16 installs with the pinned torch and
    # transformers). parameterized: transformers' own model tests (tests/transformers_suite) import it.
    # schemathesis: tests/serving/test_fuzz.py fuzzes the server's /openapi.json (4.x: its Python API and checks).
    "tests": [
        "pytest>=8",
        "pytest-xdist>=3",
        "ruff>=0.6",
        "filelock>=3",
        "trl>=1.16,<2",
        "parameterized>=0.9",
        "schemathesis>=4.3,<5",
    ],
    # `python -m optimum.habana.serve`: transformers' server and its dependencies (fastapi, uvicorn, openai, ...).
    "serving": [f"transformers[serving]{TRANSFORMERS}"],
    # examples/text-generation/run_lm_eval.py: lm-evaluation-harness; 0.4.9.x (Optimum-Habana's pin) does not import
    # with transformers 5 (it reads the removed AutoModelForVision2Seq); 0.4.10, 0.4.12 and 0.4.13 pass the tests.
    "eval": ["lm_eval>=0.4.10,<0.5"],
}

setup(
    name="optimum-gaudi-flash",
    version=VERSION,
    description="Flash attention for transformers' causal LMs on Intel Gaudi (HPU), CUDA and CPU, on transformers 5",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_namespace_packages(include=["optimum.*"]),
    # The long prompt of run_generation.py's --book_source, and run_lm_eval.py's offline tasks (their YAML files,
    # flash_mc's items, their README); all written for this project, Apache-2.0 like the code. The CPU decode
    # kernel's C source, compiled on the user's machine at first use (optimum/habana/kernels/cpu_decode.py).
    package_data={
        "optimum.habana.kernels": ["*.c"],
        "optimum.habana.cli": ["data/*.txt"],
        "optimum.habana.cli.evaluation.lm_eval": ["tasks/README.md", "tasks/*/*.yaml", "tasks/*/*.jsonl"],
    },
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
