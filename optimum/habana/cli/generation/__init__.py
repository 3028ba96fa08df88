"""`examples/text-generation/run_generation.py`: everything the script runs, except its top-to-bottom `main`."""
