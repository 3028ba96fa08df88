"""`--dataset_name` / `--column_name`: prompts read from a dataset with the `datasets` library, as Optimum-Habana's
run_generation.py takes them, plus local data files (no hub needed)."""

from pathlib import Path


# Local files `datasets` reads with a packaged builder, by suffix.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def dataset_prompts(dataset_name: str, column_name: str | None) -> list[str]:
    """The non-empty texts of one column; a ValueError names the flag and what to pass instead."""
    import datasets

    path = Path(dataset_name).expanduser()
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise ValueError(
                    f"--dataset_name {dataset_name!r}: a file must be one of {', '.join(FILE_BUILDERS)}; or pass a "
                    "dataset folder or hub id."
                )
            loaded = datasets.load_dataset(builder, data_files=str(path))
        else:
            loaded = datasets.load_dataset(dataset_name)
    except (FileNotFoundError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as error:
        detail = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"--dataset_name {dataset_name!r} cannot be loaded: {detail}") from None
    split = loaded["train"] if "train" in loaded else loaded[next(iter(loaded))]
    text_columns = [name for name, feature in split.features.items() if getattr(feature, "dtype", None) == "string"]
    column = column_name or (text_columns[0] if text_columns else None)
    if column is None or column not in text_columns:
        raise ValueError(
            f"--column_name {column!r} is not a text column of {dataset_name!r}; its text columns: "
            f"{', '.join(text_columns) or 'none'}."
        )
    prompts = [text for text in split[column] if isinstance(text, str) and text.strip()]
    if not prompts:
        raise ValueError(f"--dataset_name {dataset_name!r}: column {column!r} holds no text.")
    return prompts
