"""`--torch_compile` and `--use_hpu_graphs`: what run_generation.py captures as graphs on this device, and how many.

With `--torch_compile` the prompt's forward is compiled (one graph per prompt shape) and generate() compiles the
decode step itself (one graph per cache bucket; the cache is static). With `--use_hpu_graphs` on Gaudi both are
recorded as HPU graphs (the decode steps only with `--limit_hpu_graphs`). After the runs one line says how many graphs
torch.compile built and how many graph breaks it met: a model that runs as one graph per phase has none.
"""

import functools
from typing import Any

import torch

from optimum.habana import hpu
from optimum.habana.utils.graph_capture import GraphReport

from .arguments import ExecutionArguments


def describe_compilation(report: GraphReport, backend: str, num_beams: int) -> str:
    """The line printed after the runs of --torch_compile."""
    breaks = "no graph break" if report.graph_breaks == 0 else f"{report.graph_breaks} graph break(s)"
    reason = eager_decode_reason(num_beams)
    decode = "the decode step per cache bucket" if reason is None else f"no decode step: {reason}"
    return f"torch.compile ({backend}): {report.graphs} graph(s) compiled (the prompt per input shape, {decode}), {breaks}"


def eager_decode_reason(num_beams: int) -> str | None:
    """Why generate() runs the decode step eagerly under --torch_compile, or None where it compiles it: it compiles
    it in greedy search and sampling only (transformers' `_sample`)."""
    if num_beams > 1:
        return f"--num_beams {num_beams}: generate() compiles the decode step of greedy search and sampling only"
    return None


def is_captured(execution: ExecutionArguments, device: torch.device) -> bool:
    """Whether a run captures graphs on `device`: --torch_compile, or HPU graphs on Gaudi."""
    return execution.torch_compile or (execution.use_hpu_graphs and device.type == "hpu")


def capture(model: Any, execution: ExecutionArguments, device: torch.device) -> Any:
    """The model as the runs call it: its prompt compiled, or recorded in HPU graphs, or as it is."""
    if execution.use_hpu_graphs and device.type == "hpu":
        return hpu.wrap_in_hpu_graph(model, prompt_in_graph=not execution.limit_hpu_graphs)
    if execution.torch_compile:
        compile_prompt(model, compile_backend(execution, device))
    return model


def compile_backend(execution: ExecutionArguments, device: torch.device) -> str:
    """--torch_compile_backend, or the device's compiler; Gaudi's asked for elsewhere is inductor (a note says so)."""
    backend = execution.torch_compile_backend
    if backend is None or (backend == hpu.COMPILE_BACKEND and device.type != "hpu"):
        return hpu.COMPILE_BACKEND if device.type == "hpu" else "inductor"
    return backend


def compile_prompt(model: Any, backend: str) -> None:
    """Route the model's forwards over more than one new token (prompts) through a compiled forward.

    Decode steps keep the eager forward: generate() compiles them itself, tracing through this one.
    """
    eager = model.forward
    compiled = torch.compile(eager, dynamic=False, backend=backend)

    @functools.wraps(eager)  # generate() reads the forward's signature
    def forward(*args: Any, **kwargs: Any) -> Any:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        is_prompt = tokens is not None and tokens.shape[1] > 1
        if is_prompt and not torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        return eager(*args, **kwargs)

    model.forward = forward


__all__ = [
    "capture",
    "compile_backend",
    "compile_prompt",
    "describe_compilation",
    "eager_decode_reason",
    "is_captured",
]
