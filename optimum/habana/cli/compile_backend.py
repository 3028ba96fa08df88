"""`--torch_compile_backend`, checked alike by run_generation.py, run_lm_eval.py and run_lora_clm.py before the model
loads: it comes with `--torch_compile`, names a backend torch.compile knows (or Gaudi's), and runs here.

`torch._dynamo.list_backends()` lists backends whose package is not installed (`tvm`, `openxla`) or that cannot
compile in this torch (`ts`): each failed only once the model had loaded and generation compiled, in a
`BackendCompilerFailed` traceback. Here each backend but torch's own is tried once on a function of one tensor.
"""

import functools
import warnings

import torch

from optimum.habana import hpu


# torch's own backends, which need nothing beyond torch: not tried.
BUILT_IN = ("inductor", "eager", "aot_eager")


def known_backends() -> set[str]:
    """torch.compile's backends (but its own test doubles, made to fail: `relu_compile_error_TESTING_ONLY`), and
    Gaudi's: each is accepted by name."""
    listed = torch._dynamo.list_backends(exclude_tags=())
    return {name for name in listed if not name.endswith("_TESTING_ONLY")} | {hpu.COMPILE_BACKEND}


def offered_backends() -> set[str]:
    """The backends an error message offers: torch's user-facing ones (`list_backends()` leaves out its debugging
    and experimental ones: the minifiers, `eager_noexcept`, `invoke_subgraph`...), its reference backends `eager`
    and `aot_eager`, and Gaudi's."""
    return {*torch._dynamo.list_backends(), "eager", "aot_eager", hpu.COMPILE_BACKEND}


def check_compile_backend(backend: str | None, torch_compile: bool, allowed: set[str] | None = None) -> None:
    """A ValueError naming `--torch_compile_backend` when it cannot be honoured; `allowed`: the names the script's
    engine takes besides (the Trainer's accelerate knows fewer than torch)."""
    if backend is None:
        return
    if not torch_compile:
        raise ValueError(f"--torch_compile_backend {backend} picks torch.compile's backend: add --torch_compile.")
    known = known_backends() if allowed is None else known_backends() & allowed
    if backend not in known:
        raise ValueError(
            f"--torch_compile_backend {backend} is not a torch.compile backend"
            + ("" if allowed is None else " this script can use")
            + f"; choose one of: {', '.join(sorted(offered_backends() & known))}."
        )
    problem = backend_problem(backend)
    if problem is not None:
        raise ValueError(
            f"--torch_compile_backend {backend} cannot compile here ({problem}): take inductor (the default when it "
            "is left out), or install what this backend needs."
        )


@functools.cache
def backend_problem(backend: str) -> str | None:
    """Why torch.compile cannot run `backend` on this machine, in one line; None when it compiles a function of one
    tensor (torch's own backends and Gaudi's, whose import `hpu` checks, are not tried)."""
    if backend in BUILT_IN or backend == hpu.COMPILE_BACKEND:
        return None
    if backend == "cudagraphs" and not torch.cuda.is_available():
        return "it records CUDA graphs, and this machine has no CUDA device"
    try:
        with warnings.catch_warnings():  # the backend's own (TorchScript's deprecation...): the line below says it
            warnings.simplefilter("ignore")
            torch.compile(lambda tensor: tensor * 2 + 1, backend=backend, fullgraph=True)(torch.ones(2))
    except Exception as error:
        return compile_failure(error)
    return None


def compile_failure(error: Exception) -> str:
    """A failed compilation in one line: the backend's own error, which BackendCompilerFailed wraps."""
    cause = getattr(error, "inner_exception", None) or error.__cause__ or error
    words = (str(cause).strip().splitlines() or [""])[0]
    return f"{type(cause).__name__}: {words}" if words else type(cause).__name__


__all__ = ["backend_problem", "check_compile_backend", "compile_failure", "known_backends", "offered_backends"]
