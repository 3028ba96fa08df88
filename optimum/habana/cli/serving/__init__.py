"""`python -m optimum.habana.serve`: transformers' OpenAI-compatible server on the Gaudi classes."""
