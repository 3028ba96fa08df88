"""`examples/text-generation/attention_fidelity.py`: how far the fused and the default attention paths are from a
float64 reference, per call and for a whole model.
"""
