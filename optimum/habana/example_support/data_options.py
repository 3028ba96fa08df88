"""Optimum-Habana's data options for fine-tuning: other column names, and fewer examples."""

from datasets import Dataset, DatasetDict

from .errors import FineTuningError


# The column each option renames, and the name the rest of the pipeline reads.
COLUMN_OPTIONS = {
    "instruction_column_name": "instruction",
    "input_column_name": "input",
    "output_column_name": "output",
}


def column_renames(arguments: object) -> dict[str, str]:
    """`{given name: our name}` for each column option given with another name than ours."""
    renames = {}
    for option, ours in COLUMN_OPTIONS.items():
        given = getattr(arguments, option)
        if given is not None and given != ours:
            renames[given] = ours
    return renames


def rename_columns(dataset: Dataset, renames: dict[str, str], source: str) -> Dataset:
    """The dataset with its columns renamed; a missing column, or one that would hide another, names the option."""
    options = {ours: option for option, ours in COLUMN_OPTIONS.items()}
    for given, ours in renames.items():
        if given not in dataset.column_names:
            raise FineTuningError(
                f"--{options[ours]} {given!r}: {source} has no such column (its columns: "
                f"{', '.join(dataset.column_names)})."
            )
        if ours in dataset.column_names:
            raise FineTuningError(
                f"--{options[ours]} {given!r}: {source} also has a column {ours!r}; rename or drop one of them."
            )
    return dataset.rename_columns(renames) if renames else dataset


def limit_examples(datasets: DatasetDict, max_train_samples: int | None, max_eval_samples: int | None) -> DatasetDict:
    """The first `max_train_samples` training and `max_eval_samples` validation examples (None: all)."""
    limits = {"train": max_train_samples, "validation": max_eval_samples}
    return DatasetDict(
        {
            split: dataset
            if limits.get(split) is None
            else dataset.select(range(min(limits[split], dataset.num_rows)))
            for split, dataset in datasets.items()
        }
    )


__all__ = ["COLUMN_OPTIONS", "column_renames", "limit_examples", "rename_columns"]
