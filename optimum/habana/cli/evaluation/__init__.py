"""Accuracy: lm-evaluation-harness scores through the Gaudi attention (`lm_eval`, run_lm_eval.py) and each attention
path's distance to the exact answer (`fidelity`, attention_fidelity.py).
"""
