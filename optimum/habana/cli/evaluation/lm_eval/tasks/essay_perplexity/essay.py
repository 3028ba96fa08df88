"""The essay_perplexity documents: the essay shipped with the examples, one document per section.

`optimum/habana/cli/data/long_prompt.txt` (written for this project, Apache-2.0, about 11,000 tokens)
is read where the package installed it and cut at its section headings: eleven documents of about a thousand
tokens, so the rolling log-likelihood runs a handful of moderate forwards, not one 11k-token one.
"""

from pathlib import Path
from typing import Any


ESSAY_PATH = Path(__file__).resolve().parents[4] / "data" / "long_prompt.txt"
HEADING_MAX_CHARACTERS = 100


def is_heading(paragraph: str) -> bool:
    """A short one-line paragraph that does not end a sentence: a section title."""
    return "\n" not in paragraph and len(paragraph) < HEADING_MAX_CHARACTERS and paragraph[-1] not in ".!?:\"'"


def essay_sections(text: str) -> list[str]:
    """Each section with its heading; the essay's title stays with the first section."""
    paragraphs = [paragraph.strip() for paragraph in text.split("\n\n") if paragraph.strip()]
    sections: list[list[str]] = []
    for paragraph in paragraphs:
        starts_section = is_heading(paragraph) and sections and not is_heading(sections[-1][-1])
        if starts_section or not sections:
            sections.append([])
        sections[-1].append(paragraph)
    return ["\n\n".join(section) for section in sections]


def load_dataset(**metadata: Any) -> Any:
    """The task's DatasetDict (one test split); lm-eval passes the task's metadata, unused here."""
    import datasets

    sections = essay_sections(ESSAY_PATH.read_text(encoding="utf-8"))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([{"text": text} for text in sections])})
