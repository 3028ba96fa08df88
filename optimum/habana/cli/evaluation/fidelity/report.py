"""The fidelity report: the targets judged on the measurements, the Markdown tables and the two result files.

Everything here formats what `attention` and `model` measured; nothing measures. A value a
device cannot produce is shown as the reason ("n/a on cpu"), never as a number.
"""

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from optimum.habana.utils.atomic import atomic_write_text

from .attention import DEFAULT, FAST_SOFTMAX, FUSED, SOFTMAX_IN_MODEL_DTYPE


RESULT_FILES = ("results.json", "results.md")


# The targets of docs/fidelity.md: the fused path's error at most this many times the default path's, per cell;
# the bf16 perplexity with the flag within this fraction of the default path's.
ERROR_RATIO_TARGET = 1.1


PERPLEXITY_TARGET = 0.001


SWEEP_TITLES = {
    "lengths": "Sequence length",
    "geometry": "Head dim x GQA ratio",
    "padded": "Left-padded batch (rows of N and 3N/4 real tokens; errors over real tokens only)",
    "full": "Every combination",
}


def error_cell(result: dict[str, Any] | None) -> str:
    """`max / mean` absolute error, or why there is none."""
    if result is None:
        return ""
    if result.get("status") != "ok":
        return result.get("reason", result.get("status", ""))
    return f"{result['max_abs_error']:.2e} / {result['mean_abs_error']:.2e}"


def error_ratios(paths: dict[str, dict[str, Any]]) -> dict[str, float] | None:
    """The fused path's max and mean error over the default path's; None when either is missing."""
    fused, default = paths.get(FUSED, {}), paths.get(DEFAULT, {})
    if fused.get("status") != "ok" or default.get("status") != "ok":
        return None
    return {name: ratio(fused[f"{name}_abs_error"], default[f"{name}_abs_error"]) for name in ("max", "mean")}


def ratio(numerator: float, denominator: float) -> float:
    if denominator == 0:
        return 1.0 if numerator == 0 else math.inf
    return numerator / denominator


def target_verdict(ratios: dict[str, float] | None) -> str:
    if ratios is None:
        return "not measured"
    missed = [name for name, value in ratios.items() if value > ERROR_RATIO_TARGET]
    return "yes" if not missed else f"no ({', '.join(missed)})"


def ratio_cell(ratios: dict[str, float] | None) -> str:
    return "" if ratios is None else f"{ratios['max']:.2f} / {ratios['mean']:.2f}"


def attention_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    rows = []
    for record in records:
        ratios = error_ratios(record["paths"])
        rows.append(
            {
                "dtype": record["dtype"],
                "N": str(record["seq_len"]),
                "D": str(record["head_dim"]),
                "GQA (q/kv heads)": f"{record['gqa']} ({record['query_heads']}/{record['kv_heads']})",
                "batch": str(record["batch"]),
                "fused max / mean": error_cell(record["paths"].get(FUSED)),
                "default max / mean": error_cell(record["paths"].get(DEFAULT)),
                "fused / default": ratio_cell(ratios),
                "default + attn_softmax_bf16": error_cell(record["paths"].get(SOFTMAX_IN_MODEL_DTYPE)),
                "fused + fast softmax": error_cell(record["paths"].get(FAST_SOFTMAX)),
                f"fused <= {ERROR_RATIO_TARGET}x default": target_verdict(ratios),
            }
        )
    return rows


def logits_rows(model: dict[str, Any]) -> list[dict[str, str]]:
    rows = []
    for length in model["logit_lens"]:
        segment = next((s for s in model["segments"] if s["start"] == 0 and s["length"] == length), None)
        if segment is None:  # a partial report: not measured yet
            continue
        for dtype, paths in segment["dtypes"].items():
            ratios = error_ratios(paths)
            rows.append(
                {
                    "dtype": dtype,
                    "tokens": str(length),
                    "fused max / mean": error_cell(paths.get(FUSED)),
                    "default max / mean": error_cell(paths.get(DEFAULT)),
                    "fused / default": ratio_cell(ratios),
                    "fused + fast softmax": error_cell(paths.get(FAST_SOFTMAX)),
                    f"fused <= {ERROR_RATIO_TARGET}x default": target_verdict(ratios),
                }
            )
    return rows


def perplexity_change(values: dict[str, Any]) -> float | None:
    """(fused - default) / default, or None when either is missing."""
    fused, default = values.get(FUSED), values.get(DEFAULT)
    if not isinstance(fused, float) or not isinstance(default, float):
        return None
    return fused / default - 1.0


def perplexity_value(value: Any, digits: int = 4) -> str:
    """A perplexity, or why there is none."""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value or "")


def relative_change(value: Any, reference: float) -> str:
    return f"{100 * (value / reference - 1):+.4f} %" if isinstance(value, float) else "-"


def change_error(model: dict[str, Any], dtype: str) -> float | None:
    """The standard error of the fused path's relative perplexity change (older reports have none)."""
    return model["perplexity"].get("change_standard_error", {}).get(dtype, {}).get(FUSED)


def perplexity_rows(model: dict[str, Any]) -> list[dict[str, str]]:
    table = model["perplexity"]["perplexity"]
    rows = [{"dtype": "fp64 (reference)", "default": perplexity_value(table["reference"])}]
    for dtype, values in table.items():
        if dtype == "reference":
            continue
        change, error = perplexity_change(values), change_error(model, dtype)
        rows.append(
            {
                "dtype": dtype,
                "default": perplexity_value(values.get(DEFAULT)),
                "fused": perplexity_value(values.get(FUSED)),
                "fused vs default": ""
                if change is None
                else f"{100 * change:+.4f} %" + ("" if error is None else f" ± {100 * error:.4f} %"),
                "fused + fast softmax": perplexity_value(values.get(FAST_SOFTMAX)),
                "default / fused vs fp64": " / ".join(
                    relative_change(values.get(path), table["reference"]) for path in (DEFAULT, FUSED)
                ),
            }
        )
    return rows


def judge_targets(report: dict[str, Any]) -> dict[str, Any]:
    """The docs' targets on these measurements: counts of cells that meet the error ratio, the perplexity check."""
    targets: dict[str, Any] = {}
    distinct = {}
    for record in report.get("attention", []):
        key = (record["dtype"], record["seq_len"], record["head_dim"], record["gqa"], record["padded"])
        distinct[key] = error_ratios(record["paths"])
    model = report.get("model")
    logits = {}
    if model:
        for segment in model["segments"]:
            if segment["start"] == 0 and segment["length"] in model["logit_lens"]:
                for dtype, paths in segment["dtypes"].items():
                    logits[(dtype, segment["length"])] = error_ratios(paths)
    for name, cells in (("attention", distinct), ("logits", logits)):
        if not cells:
            continue
        measured = {key: value for key, value in cells.items() if value is not None}
        targets[f"{name}_error_ratio"] = {
            "cells": len(measured),
            **{
                f"{kind}_met": sum(value[kind] <= ERROR_RATIO_TARGET for value in measured.values())
                for kind in ("max", "mean")
            },
            "worst": {
                kind: max((value[kind] for value in measured.values()), default=None) for kind in ("max", "mean")
            },
        }
    if model and "perplexity" in model:
        for dtype, values in model["perplexity"]["perplexity"].items():
            change = perplexity_change(values) if isinstance(values, dict) else None
            if change is not None:
                targets[f"perplexity_{dtype}"] = {
                    "change": change,
                    "standard_error": change_error(model, dtype),
                    "met": abs(change) <= PERPLEXITY_TARGET,
                }
    return targets


def markdown(report: dict[str, Any]) -> str:
    """The whole report as Markdown: the command, the machine, every table and the targets."""
    lines = [
        "# Attention fidelity: each path against float64",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Device: {report['device']}; machine: {report['hardware']['cpu']}, {report['hardware']['cores']} cores, "
        f"{report['hardware']['torch_threads']} torch threads; versions: "
        + ", ".join(f"{name} {version}" for name, version in report["versions"].items())
        + ("" if report.get("complete") else " (INCOMPLETE: the run stopped early)")
        + (
            f"; {report['seconds']['wall'] / 60:.1f} min wall, {report['seconds']['process_cpu'] / 60:.1f} min CPU"
            if "seconds" in report
            else ""
        ),
        "",
    ]
    records = report.get("attention", [])
    if records:
        lines += ["## Attention output: max / mean absolute error against float64", ""]
        for sweep, title in SWEEP_TITLES.items():
            chosen = [record for record in records if record["sweep"] == sweep]
            if chosen:
                lines += [f"### {title}", "", tabulate(attention_rows(chosen), headers="keys", tablefmt="github"), ""]
    model = report.get("model")
    if model:
        lines += [f"## Model logits: {model['model']}, max / mean absolute error against float64", ""]
        rows = logits_rows(model)
        if rows:
            lines += [tabulate(rows, headers="keys", tablefmt="github"), ""]
        check, norms = model["reference_check"], model["reference_norms"]
        kept = f"; kept in fp32: {', '.join(norms['norm_classes_kept'])}" if norms["norm_classes_kept"] else ""
        lines += [
            f"The reference: the model in float64 on the default path, softmax and {norms['rms_norms_in_float64']} "
            f"RMSNorms in float64{kept}. Its check ({check['tokens']} tokens, the same float64 model): fused path "
            f"{error_cell(check['fp64_fused'])}; default path with its fp32 softmax "
            f"{error_cell(check['fp64_default_fp32_softmax'])}.",
            "",
        ]
        if "perplexity" in model:
            ppl = model["perplexity"]
            lines += [
                f"## Perplexity on {model['text']} ({ppl['predicted_tokens']} predicted tokens, {ppl['windows']} "
                f"windows of {model['ppl_window']} tokens)",
                "",
                tabulate(perplexity_rows(model), headers="keys", tablefmt="github"),
                "",
            ]
    lines += ["## Targets", ""] + [f"- {line}" for line in target_lines(report.get("targets", {}))] + [""]
    return "\n".join(lines)


def target_lines(targets: dict[str, Any]) -> list[str]:
    lines = []
    for name in ("attention", "logits"):
        entry = targets.get(f"{name}_error_ratio")
        if entry:
            lines.append(
                f"{name}: fused error <= {ERROR_RATIO_TARGET}x default in {entry['max_met']} of {entry['cells']} cells "
                f"by max error, {entry['mean_met']} of {entry['cells']} by mean error (worst ratios: max "
                f"{entry['worst']['max']:.2f}, mean {entry['worst']['mean']:.2f})"
            )
    for name, entry in targets.items():
        if name.startswith("perplexity_"):
            error = entry.get("standard_error")
            spread = "" if error is None else f" ± {100 * error:.4f} % (standard error)"
            unresolved = error is not None and abs(abs(entry["change"]) - PERPLEXITY_TARGET) < 2 * error
            lines.append(
                f"{name.removeprefix('perplexity_')} perplexity, fused vs default: {100 * entry['change']:+.4f} %"
                f"{spread} ({'within' if entry['met'] else 'outside'} {100 * PERPLEXITY_TARGET:.1f} %"
                + (
                    "; less than two standard errors from the limit: not resolved by this many tokens)"
                    if unresolved
                    else ")"
                )
            )
    return lines


def write_report(output_dir: Path, report: dict[str, Any]) -> list[Path]:
    """results.json and results.md, each written atomically: a killed run leaves whole files (marked incomplete)."""
    atomic_write_text(output_dir / RESULT_FILES[0], json.dumps(report, indent=2) + "\n")
    atomic_write_text(output_dir / RESULT_FILES[1], markdown(report))
    return [output_dir / name for name in RESULT_FILES]
