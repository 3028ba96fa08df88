"""`python -m optimum.habana.families [--model_type TYPE] [--qualifying]`

Which causal-LM families of the installed transformers run the Gaudi attention, with the attention variant of each
and what takes the fused path, or, for the others, why not: the table of docs/families.md, printed from the code
(`optimum.habana.cli.families`).
"""

from .cli.families import main


if __name__ == "__main__":
    main()
