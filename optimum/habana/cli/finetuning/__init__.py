"""`examples/language-modeling/run_lora_clm.py`: LoRA (and other PEFT) fine-tuning of a Gaudi causal LM with
transformers' Trainer, with Optimum-Habana's command lines.
"""
