"""The cells and table formats every benchmark report shares: a failed measurement reads OOM, timeout or error."""

import csv
import io
from collections.abc import Sequence
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


def csv_text(rows: Sequence[dict[str, str]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()
