"""`python -m optimum.habana.families`: the family table, as docs/families.md holds it, from the code that decides.

The verdicts come from `optimum.habana.transformers.families.qualification` for the installed transformers: the
first run reads every family's code (seconds), later runs read the cache (`models/registry.py`).
"""

import sys
from dataclasses import dataclass, field

import transformers
from transformers import HfArgumentParser
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from optimum.habana.transformers.families.qualification import FUSED_PATHS, FamilyReport, causal_lm_family
from optimum.habana.transformers.models import family_table, gaudi_model_class, supported_model_types


COLUMNS = ("model type", "class", "attention variant", "fused path", "transformers' `_supports_attention_backend`")


@dataclass
class FamilyTableArguments:
    model_type: str | None = field(default=None, metadata={"help": "Print this model type's row only."})
    qualifying: bool = field(default=False, metadata={"help": "Only the model types that have a Gaudi class."})
    summary: bool = field(
        default=False,
        metadata={"help": "One row per attention variant: its families, and how the fused path runs it."},
    )


def marked_by_transformers(model_type: str) -> str:
    """transformers' own mark on the stock causal LM (`_supports_attention_backend`): a hint that its attention looks
    its function up in the interface, which the library's verdict proves or refutes (docs/families.md)."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    stock = getattr(transformers, name, None) if isinstance(name, str) else None
    if stock is None:
        return ""
    return "yes" if getattr(stock, "_supports_attention_backend", False) else "no"


def row(report: FamilyReport) -> tuple[str, str, str, str, str]:
    marked = marked_by_transformers(report.model_type)
    if not report.qualifies:
        return (
            report.model_type,
            f"`{report.class_name}` (stock)" if report.class_name else "",
            "",
            report.fused_path,
            marked,
        )
    gaudi_class = gaudi_model_class(report.model_type).__name__
    return (report.model_type, f"`{gaudi_class}`", "; ".join(report.variants), report.fused_path, marked)


def markdown_table(reports: list[FamilyReport]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row(report)) + " |" for report in reports]
    return "\n".join(lines)


def summary_table(reports: list[FamilyReport]) -> str:
    """One row per variant (a family with several is in each), and one for the families refused."""
    lines = ["| attention variant | families | fused path |", "|---|---|---|"]
    for variant, fused_path in FUSED_PATHS.items():
        members = [report.model_type for report in reports if report.qualifies and variant in report.variants]
        if members:
            lines.append(f"| {variant} | {len(members)}: {', '.join(members)} | {fused_path} |")
    refused = [report.model_type for report in reports if not report.qualifies]
    if refused:
        lines.append(
            f"| (not supported) | {len(refused)} | each refused in one line: `python -m optimum.habana.families "
            "--model_type TYPE` says why |"
        )
    return "\n".join(lines)


def ordered_reports(qualifying: bool = False) -> list[FamilyReport]:
    """The supported families in `supported_model_types()`'s order (the written 14 first), then the others."""
    table = family_table()
    supported = supported_model_types()
    reports = [table[model_type] for model_type in supported]
    if not qualifying:
        reports += [table[model_type] for model_type in sorted(table) if model_type not in supported]
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser(FamilyTableArguments)
    (arguments,) = parser.parse_args_into_dataclasses(args=argv)
    reports = ordered_reports(arguments.qualifying)
    if arguments.model_type is not None:
        family = causal_lm_family(arguments.model_type)  # a config's model type reads as its family's
        if family is not None and family != arguments.model_type:
            print(f"{arguments.model_type!r} is the model type of the {family!r} family's configs.", file=sys.stderr)
        reports = [report for report in reports if report.model_type == family]
        if not reports:
            parser.error(
                f"--model_type {arguments.model_type!r} is no causal-LM model type of transformers; "
                "run without --model_type for the table."
            )
    print(summary_table(reports) if arguments.summary else markdown_table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
