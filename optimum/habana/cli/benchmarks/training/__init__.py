"""`examples/language-modeling/benchmark_training.py`: one training step per attention path, against the floor."""
