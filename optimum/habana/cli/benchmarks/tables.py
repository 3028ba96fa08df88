"""What every benchmark report shares: cells (a failed measurement reads OOM, timeout or error), table formats, the
incomplete mark of a run's files written before its end, and the plots' two log-scaled panels."""

import csv
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate


GB = 1024**3


def cell(results: dict[str, dict[str, Any]], path: str, name: str, scale: float = 1.0, digits: int = 2) -> str:
    """A measured value, or what stopped it: OOM, timeout, error."""
    result = results.get(path)
    if result is None:
        return ""
    if result["status"] != "ok":
        return {"oom": "OOM", "timeout": "timeout"}.get(result["status"], "error")
    return f"{result[name] / scale:.{digits}f}"


def number(value: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def markdown_table(rows: Sequence[dict[str, str]]) -> str:
    return tabulate(rows, headers="keys", tablefmt="github", disable_numparse=True)


# The first line of a Markdown report written before the run's end (Ctrl-C, a kill): its rows are not all there.
INCOMPLETE = "**INCOMPLETE**: the run stopped before its end; these are the measurements made so far."


def markdown_file(text: str, complete: bool) -> str:
    """A Markdown report as written to a file: marked INCOMPLETE on its first line until the run ends."""
    return text if complete else f"{INCOMPLETE}\n\n{text}"


def csv_text(rows: Sequence[dict[str, str]], complete: bool = True) -> str:
    """The rows, each with a last `complete` column: "no" in a file written before the run's end."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=[*rows[0], "complete"])
    writer.writeheader()
    writer.writerows({**row, "complete": "yes" if complete else "no"} for row in rows)
    return buffer.getvalue()


def kept(written: Sequence[Path]) -> str:
    """What Ctrl-C leaves, for its one line: the files written so far (marked incomplete), or nothing."""
    if not written:
        return "nothing was written."
    return f"the measurements so far are in {', '.join(str(path) for path in written)}, marked incomplete."


def side_by_side_axes(width: float, height: float) -> tuple[Any, tuple[Any, Any]]:
    """A figure with two panels side by side, drawn off-screen (matplotlib's Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, 2, figsize=(width, height))


def png_bytes(figure: Any, titled_axes: Sequence[tuple[Any, str]], xlabel: str) -> bytes:
    """Each panel against `xlabel` on a log2 scale, with its title and a light grid; the figure as PNG, then closed."""
    import matplotlib.pyplot as plt

    for axis, title in titled_axes:
        if axis.lines:  # a log scale needs a point: an empty panel stays linear
            axis.set_xscale("log", base=2)
        axis.set_xlabel(xlabel)
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    plt.close(figure)
    return buffer.getvalue()
