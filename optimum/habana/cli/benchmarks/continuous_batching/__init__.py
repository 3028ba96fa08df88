"""`examples/text-generation/benchmark_continuous_batching.py`: the same requests served through continuous
batching with and without the flag, stock continuous batching and static batches.
"""
