"""The default-vs-flash benchmark's report: the table users compare, its CSV and JSON files, the kernel table and
the plot. Everything here formats measurements that `command` has taken; nothing measures.
"""

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

from optimum.habana.cli.benchmarks.tables import GB, cell, csv_text, number, png_bytes, side_by_side_axes
from optimum.habana.cli.common import environment_versions, hardware
from optimum.habana.utils.atomic import atomic_write_bytes, atomic_write_text

from .arguments import PLOT_FILE, RESULT_FILES, BenchmarkArguments


def table_rows(records: Sequence[dict[str, Any]], arguments: BenchmarkArguments) -> list[dict[str, str]]:
    """The table users compare, plus prefill time, the floor and stock transformers when measured."""
    rows = []
    for record in records:
        paths = record["paths"]
        row = {
            "Model": record["model"],
            "BS": str(record["batch_size"]),
            "Max input tokens": str(record["max_input_tokens"]),
            "Max new tokens": str(record["max_new_tokens"]),
            "Default throughput [tokens/s]": cell(paths, "default", "throughput_tokens_per_second"),
            "Flash throughput [tokens/s]": cell(paths, "flash", "throughput_tokens_per_second"),
            "Throughput improvement": number(record["throughput_improvement"]),
            "Default memory [GiB]": cell(paths, "default", "peak_memory_bytes", GB),
            "Flash memory [GiB]": cell(paths, "flash", "peak_memory_bytes", GB),
            "Memory reduction [GiB]": number(record["memory_reduction_bytes"], scale=GB),
            "Default prefill [s]": cell(paths, "default", "prefill_seconds", digits=3),
            "Flash prefill [s]": cell(paths, "flash", "prefill_seconds", digits=3),
        }
        if arguments.floor:
            row["Floor extra memory [GiB]"] = cell(paths, "floor", "extra_memory_bytes", GB, digits=3)
            row["Default / floor extra"] = number(record["default_extra_vs_floor"])
            row["Flash / floor extra"] = number(record["flash_extra_vs_floor"])
        if arguments.compare_transformers:
            row["Stock eager [tokens/s]"] = cell(paths, "eager", "throughput_tokens_per_second")
            row["Stock sdpa [tokens/s]"] = cell(paths, "sdpa", "throughput_tokens_per_second")
            row["Default / eager"] = number(record["default_vs_eager"])
            row["Flash / sdpa"] = number(record["flash_vs_sdpa"])
        row["Noise [%]"] = number(record["noise_percent"], digits=1)
        rows.append(row)
    return rows


def kernel_table(report: dict[str, Any]) -> str:
    if report.get("status") != "ok":
        return f"Attention kernel report: {report.get('status')} ({report.get('error', '')})"
    rates, gemm = report["flops_per_second"], report["flops_per_second"]["gemm"]
    labels = {
        "flash": "flash path (library call)",
        "torch_sdpa": "PyTorch fused kernel alone",
        "default": "default path (matmul-softmax)",
    }
    rows = [
        [label, f"{report['seconds'][name] * 1000:.1f}", f"{rates[name] / 1e9:.1f}", f"{rates[name] / gemm:.2f}"]
        for name, label in labels.items()
    ]
    rows.append(["GEMM (fp32 square matmul)", f"{report['seconds']['gemm'] * 1000:.1f}", f"{gemm / 1e9:.1f}", "1.00"])
    return tabulate(
        rows, headers=["Attention only", "ms", "GFLOP/s", "of GEMM"], tablefmt="github", disable_numparse=True
    )


def plot_png(records: Sequence[dict[str, Any]]) -> bytes:
    """Peak memory and throughput against input length, one line per model, batch, new tokens and path."""
    figure, (memory_axis, speed_axis) = side_by_side_axes(12, 4.5)
    import matplotlib.pyplot as plt  # after side_by_side_axes has chosen the off-screen backend

    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["model"], record["batch_size"], record["max_new_tokens"]), []).append(record)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, ((model, batch, new), members) in enumerate(groups.items()):
        members = sorted(members, key=lambda record: record["max_input_tokens"])
        for path, style in (("default", "--o"), ("flash", "-s"), ("floor", ":^")):
            points = [
                (record["max_input_tokens"], record["paths"][path])
                for record in members
                if record["paths"].get(path, {}).get("status") == "ok"
            ]
            if not points:
                continue
            line = {
                "color": colors[index % len(colors)],
                "label": f"{model.split(' (')[0]}, BS {batch}, {new} new: {path}",
            }
            tokens = [tokens for tokens, _ in points]
            memory_axis.plot(tokens, [result["peak_memory_bytes"] / GB for _, result in points], style, **line)
            if path != "floor":
                throughputs = [result["throughput_tokens_per_second"] for _, result in points]
                speed_axis.plot(tokens, throughputs, style, **line)
    memory_axis.legend(fontsize=7)
    titles = ((memory_axis, "Peak memory [GiB]"), (speed_axis, "Throughput [tokens/s]"))
    return png_bytes(figure, titles, "Input tokens")


def write_results(
    output_dir: Path,
    arguments: BenchmarkArguments,
    device: torch.device,
    dtype: torch.dtype,
    records: Sequence[dict[str, Any]],
    kernel: dict[str, Any] | None,
    complete: bool,
) -> list[Path]:
    """results.json, results.csv and, when complete and asked, the plot; each written atomically."""
    table = table_rows(records, arguments)
    report = {
        "complete": complete,
        "arguments": asdict(arguments),
        "versions": environment_versions(),
        "hardware": hardware(),
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "memory_column": "device allocator peak" if device.type != "cpu" else "process peak resident memory",
        "rows": list(records),
        "table": table,
        "attention_kernel": kernel,
    }
    atomic_write_text(output_dir / "results.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(output_dir / "results.csv", csv_text(table, complete))
    written = [output_dir / name for name in RESULT_FILES]
    if complete and arguments.plot:
        atomic_write_bytes(output_dir / PLOT_FILE, plot_png(records))
        written.append(output_dir / PLOT_FILE)
    return written


def failed_runs(records: Sequence[dict[str, Any]], kernel: dict[str, Any] | None) -> list[str]:
    """Each run that ended in an error (not OOM, not a timeout), said with its row and path."""
    failures = [
        f"{record['model']} BS {record['batch_size']}, {record['max_input_tokens']} input tokens, "
        f"{record['max_new_tokens']} new, {path} path: {result['error']}"
        for record in records
        for path, result in record["paths"].items()
        if result["status"] not in ("ok", "oom", "timeout")
    ]
    if kernel is not None and kernel.get("status") not in ("ok", "oom", "timeout"):
        failures.append(f"attention kernel report: {kernel.get('error')}")
    return failures
