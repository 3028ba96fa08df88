"""How to check that a model runs as one captured graph (torch.compile, CUDA graphs, HPU graphs).

Two things split a graph, or freeze a branch into it: a graph break (code torch.compile cannot trace) and a host
read (a tensor's value copied to the host: `.item()`, `bool(t)`, `torch.equal`, `.tolist()`), which also makes the
device wait. `graph_report` traces a call with dynamo and says where it breaks; `HostReads` counts (or forbids) the
reads of an eager call, per ATen operator, so that a read inside the decoder layers shows as a count that grows with
the number of layers. `CompileCounter` counts what torch.compile built and broke while a block ran.
"""

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode


# The ATen operators that copy a tensor's value to the host (`.item()`, `int(t)`, `bool(t)`, `torch.equal`).
HOST_READ_OPERATORS = frozenset({"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"})
# Tensor methods that read values without going through ATen's dispatcher.
HOST_READ_METHODS = ("tolist", "numpy")


class HostReadError(RuntimeError):
    """A tensor's value was read to the host where no read may happen (a graph being recorded)."""


class HostReads(TorchDispatchMode):
    """Count the host reads of the code run inside `with HostReads() as reads:` (`reads.counts`, `reads.total`);
    with `forbid=True`, raise `HostReadError` at the first one instead.

    The tensor methods that bypass ATen (`tolist`, `numpy`) are counted by replacing them on `torch.Tensor` for the
    duration of the block: a checking tool, not for code that runs beside other threads.
    """

    def __init__(self, forbid: bool = False, what: str = "this block") -> None:
        super().__init__()
        self.forbid, self.what = forbid, what
        self.counts: Counter = Counter()
        self._originals: dict[str, Any] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _record(self, name: str) -> None:
        if self.forbid:
            raise HostReadError(f"{name} read a tensor's value to the host inside {self.what}")
        self.counts[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket._qualified_op_name
        if name in HOST_READ_OPERATORS:
            self._record(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> "HostReads":
        for name in HOST_READ_METHODS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original
            setattr(torch.Tensor, name, self._counted(name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for name, original in self._originals.items():
                setattr(torch.Tensor, name, original)
            self._originals.clear()

    def _counted(self, name: str, method: Callable) -> Callable:
        @functools.wraps(method)
        def counted(tensor, *args, **kwargs):
            self._record(f"Tensor.{name}")
            return method(tensor, *args, **kwargs)

        return counted


@dataclass
class GraphReport:
    """What dynamo made of one call: the graphs it captured and why it broke between them."""

    graphs: int
    graph_breaks: int
    reasons: list[str] = field(default_factory=list)

    @property
    def one_graph(self) -> bool:
        return self.graph_breaks == 0

    def describe(self) -> str:
        if self.one_graph:
            return "one graph"
        first = self.reasons[0].splitlines()[0] if self.reasons else "unknown"
        return f"{self.graphs} graphs, {self.graph_breaks} graph break(s); first: {first}"


def graph_report(function: Callable, *args: Any, **kwargs: Any) -> GraphReport:
    """Trace `function(*args, **kwargs)` with dynamo (nothing is compiled): its graphs and graph breaks."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(function)(*args, **kwargs)
    reasons = [str(reason.reason) for reason in explanation.break_reasons]
    return GraphReport(explanation.graph_count, explanation.graph_break_count, reasons)


class CompileCounter:
    """The graphs torch.compile built, and the graph breaks it met, while the `with` block ran (dynamo's counters;
    `report` is filled on exit)."""

    def __enter__(self) -> "CompileCounter":
        self._graphs = counters["stats"]["unique_graphs"]
        self._breaks = Counter(counters["graph_break"])
        self.report = GraphReport(0, 0)
        return self

    def __exit__(self, *exc: Any) -> None:
        breaks = Counter(counters["graph_break"]) - self._breaks
        self.report = GraphReport(
            counters["stats"]["unique_graphs"] - self._graphs, sum(breaks.values()), list(breaks)
        )


__all__ = ["HOST_READ_OPERATORS", "CompileCounter", "GraphReport", "HostReadError", "HostReads", "graph_report"]
