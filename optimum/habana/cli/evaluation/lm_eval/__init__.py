"""`examples/text-generation/run_lm_eval.py`: lm-evaluation-harness on the Gaudi classes, and its shipped offline
tasks (`tasks/`).
"""
