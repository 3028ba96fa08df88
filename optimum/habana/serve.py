"""`python -m optimum.habana.serve [MODEL] [transformers serve's options] [--use_flash_attention ...]`

transformers' OpenAI-compatible server on the Gaudi classes; the command lives in `optimum.habana.cli.serving`.
See docs/serving.md.
"""

from .cli.serving.command import main


if __name__ == "__main__":
    main()
