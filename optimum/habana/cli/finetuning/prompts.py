"""The prompts of instruction examples: the '### Instruction:' prompt, the model's chat template (--chat_prompt) and
the text-to-SQL prompt (--sql_prompt). Use the same prompt when asking the fine-tuned model, e.g. in run_generation.py.
"""

from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from .errors import FineTuningError


DataFormat = Literal["instruction", "text"]


PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"


PROMPT_TEMPLATE_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


SQL_PROMPT_TEMPLATE = (
    "Write the SQL query that answers the question about the tables below.\n\n"
    "### Question:\n{question}\n\n### Tables:\n{context}\n\n### SQL:\n"
)


def build_prompt(instruction: Any, input: Any = None) -> str:
    """The prompt of an instruction example: what the model sees before the response it learns to write.

    Use the same text when prompting the fine-tuned model, e.g. with run_generation.py.
    """
    instruction, input = as_text(instruction), as_text(input)
    if input.strip():
        return PROMPT_TEMPLATE_WITH_INPUT.format(instruction=instruction, input=input)
    return PROMPT_TEMPLATE.format(instruction=instruction)


def build_chat_prompt(tokenizer: PreTrainedTokenizerBase, instruction: Any, input: Any = None) -> str:
    """`--chat_prompt`: the instruction (and its input, after a blank line) as the user turn of the model's own chat
    template, ending where the assistant's answer starts. The template brings its special tokens."""
    instruction, input = as_text(instruction), as_text(input)
    content = f"{instruction}\n\n{input}" if input.strip() else instruction
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


def build_sql_prompt(question: Any, context: Any = None) -> str:
    """`--sql_prompt`: a text-to-SQL question and the tables it is about, ending where the query starts."""
    question, context = as_text(question), as_text(context)
    return SQL_PROMPT_TEMPLATE.format(question=question, context=context)


def build_styled_prompt(style: str, tokenizer: PreTrainedTokenizerBase, instruction: Any, input: Any = None) -> str:
    """The prompt of one instruction example in `style` ("instruction", "chat" or "sql")."""
    if style == "chat":
        return build_chat_prompt(tokenizer, instruction, input)
    if style == "sql":
        return build_sql_prompt(instruction, input)
    return build_prompt(instruction, input)


def check_prompt_style(style: str, tokenizer: PreTrainedTokenizerBase, data_format: DataFormat) -> None:
    if style == "instruction":
        return
    if data_format != "instruction":
        raise FineTuningError(
            f"--{style}_prompt formats instruction data (instruction/input/output fields); this data is plain text."
        )
    if style == "chat" and not tokenizer.chat_template:
        raise FineTuningError(
            "--chat_prompt: the model's tokenizer has no chat template; leave --chat_prompt out to use the "
            "'### Instruction:' prompt."
        )


def as_text(value: Any) -> str:
    """Missing values (None, e.g. an empty CSV cell) are empty text; numbers (CSV) are their text."""
    return "" if value is None else str(value)
