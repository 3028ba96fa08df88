"""The training benchmark's report: the tables, the CSV and JSON files, the target verdicts and the plot.

Everything here formats measurements that `examples/language-modeling/benchmark_training.py` has taken (one record
per row: each path's worker result and the ratios made of them); nothing measures. The cells and table format are
the shared ones (`benchmarks.tables`): a failed measurement reads OOM, timeout or error.
"""

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from optimum.habana.cli.benchmarks.tables import (
    GB,
    cell,
    csv_text,
    markdown_file,
    markdown_table,
    number,
    png_bytes,
    side_by_side_axes,
)
from optimum.habana.cli.common import environment_versions, hardware
from optimum.habana.utils.atomic import atomic_write_bytes, atomic_write_text


RESULT_FILES = ("results.json", "results.csv", "results.md")


PLOT_FILE = "training.png"


# The targets of issue 16: flash's extra memory at most this multiple of the floor's with checkpointing, ...
EXTRA_TARGET = 1.1


# ... the flag trains at this length where the default path runs out of memory, and flash is never slower than sdpa.
LONG_TARGET_TOKENS = 16384


def key_columns(record: dict[str, Any]) -> dict[str, str]:
    return {
        "Model": record["model_name"],
        "Tokens": str(record["tokens"]),
        "Batch": str(record["batch_size"]) + ("" if record["padding"] == "none" else f", {record['padding']}-padded"),
        "Mode": record["mode"],
        "GC": "on" if record["gradient_checkpointing"] else "off",
    }


def with_ratio(results: dict[str, Any], path: str, name: str, scale: float, digits: int, times: float | None) -> str:
    text = cell(results, path, name, scale, digits)
    return text if times is None else f"{text} ({times:.2f}×)"


def markdown_tables(records: Sequence[dict[str, Any]], paths: Sequence[str]) -> str:
    """The four tables: extra memory and step time with their ratio to the floor, tokens/s, peak memory."""
    memory, time, speed, peak = [], [], [], []
    for record in records:
        results, keys = record["paths"], key_columns(record)
        memory.append(
            keys | {p: with_ratio(results, p, "extra_memory_bytes", GB, 3, record["extra_vs_floor"][p]) for p in paths}
        )
        time.append(
            keys | {p: with_ratio(results, p, "step_seconds", 1, 2, record["step_vs_floor"][p]) for p in paths}
        )
        if "flash" in paths and "sdpa" in paths:
            time[-1]["flash / sdpa"] = number(record["flash_step_vs_sdpa"])
        speed.append(keys | {p: cell(results, p, "tokens_per_second", digits=0) for p in paths})
        peak.append(keys | {p: cell(results, p, "peak_memory_bytes", GB, 2) for p in paths})
    titles = (
        "Extra memory of the step over the built model [GiB] (× the floor's)",
        "Step time, forward + backward [s] (× the floor's)",
        "Tokens per second (real tokens, padding excluded)",
        "Peak resident memory [GiB]",
    )
    tables = (memory, time, speed, peak)
    return "\n\n".join(f"{title}:\n\n{markdown_table(table)}" for title, table in zip(titles, tables, strict=True))


def csv_rows(records: Sequence[dict[str, Any]], paths: Sequence[str]) -> list[dict[str, str]]:
    """One line per row, every path's numbers in their own columns (GiB, seconds)."""
    rows = []
    for record in records:
        results, row = record["paths"], key_columns(record)
        for path in paths:
            row[f"{path} step [s]"] = cell(results, path, "step_seconds", digits=4)
            row[f"{path} tokens/s"] = cell(results, path, "tokens_per_second", digits=1)
            row[f"{path} peak [GiB]"] = cell(results, path, "peak_memory_bytes", GB, 4)
            row[f"{path} extra [GiB]"] = cell(results, path, "extra_memory_bytes", GB, 4)
            row[f"{path} extra / floor"] = number(record["extra_vs_floor"][path], 3)
            row[f"{path} step / floor"] = number(record["step_vs_floor"][path], 3)
        row["flash step / sdpa step"] = number(record["flash_step_vs_sdpa"], 3)
        rows.append(row)
    return rows


def target_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """Each target of the issue: met, not met, or not measured, with the numbers it was judged on."""
    lines = []
    memory = [(r["row"], r["extra_vs_floor"].get("flash")) for r in records if r["gradient_checkpointing"]]
    memory = [(name, value) for name, value in memory if value is not None]
    if memory:
        over = [f"{name}: {value:.2f}×" for name, value in memory if value > EXTRA_TARGET]
        worst = max(value for _, value in memory)
        verdict = "met" if not over else "NOT met (" + "; ".join(over) + ")"
        lines.append(
            f"Flash extra memory <= {EXTRA_TARGET}× the floor's with gradient checkpointing: {verdict}; "
            f"highest {worst:.2f}× over {len(memory)} row(s)."
        )
    else:
        lines.append("Flash extra memory vs the floor with gradient checkpointing: not measured (no such row).")
    long = [r for r in records if r["tokens"] >= LONG_TARGET_TOKENS and "flash" in r["paths"]]
    if long:
        flash_ok = [r for r in long if r["paths"]["flash"]["status"] == "ok"]
        default_oom = [r for r in long if r["paths"].get("default", {}).get("status") == "oom"]
        default_run = [r for r in long if "default" in r["paths"]]
        if len(flash_ok) < len(long) or len(default_oom) < len(default_run):
            verdict = "NOT met"
        else:
            verdict = "met" if default_run else "not judged (the default path was not run)"
        lines.append(
            f"Flash trains at {LONG_TARGET_TOKENS}+ tokens where the default path runs out of memory: {verdict}; "
            f"flash trained in {len(flash_ok)}/{len(long)} row(s), the default path ran out of memory in "
            f"{len(default_oom)}/{len(default_run)}."
        )
    else:
        lines.append(f"Flash trains at {LONG_TARGET_TOKENS} tokens: not measured (no row that long).")
    speed = [(r["row"], r["flash_step_vs_sdpa"]) for r in records if r["flash_step_vs_sdpa"] is not None]
    if speed:
        slower = [f"{name}: {value:.2f}×" for name, value in speed if value > 1.0]
        verdict = "met" if not slower else "NOT met (" + "; ".join(slower) + ")"
        lines.append(
            f"Flash step time <= stock sdpa's: {verdict}; flash / sdpa from {min(v for _, v in speed):.2f} to "
            f"{max(v for _, v in speed):.2f} over {len(speed)} row(s)."
        )
    else:
        lines.append("Flash step time vs stock sdpa: not measured (needs both paths).")
    return lines


def plot_png(records: Sequence[dict[str, Any]], paths: Sequence[str]) -> bytes:
    """Extra memory / floor's and step time against tokens, one line per row group and path."""
    figure, (memory_axis, time_axis) = side_by_side_axes(13, 4.8)
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(record["group"], []).append(record)
    for group, members in groups.items():
        for path in paths:
            points = [(r["tokens"], r) for r in members if r["paths"][path].get("status") == "ok"]
            if not points:
                continue
            label = f"{group}: {path}"
            ratios = [(t, r["extra_vs_floor"][path]) for t, r in points if r["extra_vs_floor"][path] is not None]
            if path != "floor" and ratios:  # no ratio where the floor's extra memory is unknown or 0
                memory_axis.plot([t for t, _ in ratios], [ratio for _, ratio in ratios], "-o", label=label)
            time_axis.plot(
                [t for t, _ in points], [r["paths"][path]["step_seconds"] for _, r in points], "-o", label=label
            )
    if memory_axis.lines:  # a panel without a point (every run OOM, say) stays empty instead of failing the plot
        memory_axis.axhline(EXTRA_TARGET, color="gray", linestyle=":", label=f"target {EXTRA_TARGET}×")
    if time_axis.lines:
        time_axis.set_yscale("log")
        time_axis.legend(fontsize=6)
    return png_bytes(
        figure, ((memory_axis, "Extra memory / floor's"), (time_axis, "Step time [s]")), "Tokens per sequence"
    )


def markdown_report(records: Sequence[dict[str, Any]], paths: Sequence[str], notes: Sequence[str]) -> str:
    """The tables, the notes on the models, and the verdict on each target."""
    targets = "\n".join(f"- {line}" for line in target_lines(records))
    notes_text = "".join(f"{note}\n" for note in notes)
    return f"{markdown_tables(records, paths)}\n\n{notes_text}\nTargets:\n{targets}\n"


def write_results(
    output_dir: Path,
    arguments: argparse.Namespace,
    header: str,
    notes: Sequence[str],
    records: Sequence[dict[str, Any]],
    complete: bool,
) -> list[Path]:
    """results.json, results.csv, results.md and, once complete, the plot; each written atomically."""
    report = {
        "complete": complete,
        "arguments": vars(arguments),
        "versions": environment_versions(),
        "hardware": hardware(),
        "dtype": "float32",
        "header": header,
        "notes": list(notes),
        "rows": list(records),
        "targets": target_lines(records),
    }
    atomic_write_text(output_dir / "results.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(output_dir / "results.csv", csv_text(csv_rows(records, arguments.paths), complete))
    report_text = f"{header}\n\n{markdown_report(records, arguments.paths, notes)}"
    atomic_write_text(output_dir / "results.md", markdown_file(report_text, complete))
    written = [output_dir / name for name in RESULT_FILES]
    if complete:
        written.append(atomic_write_bytes(output_dir / PLOT_FILE, plot_png(records, arguments.paths)))
    return written
