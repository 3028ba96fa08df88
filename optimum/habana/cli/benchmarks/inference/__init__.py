"""`examples/text-generation/benchmark_flash_attention.py`: generation throughput, prefill time and peak memory with
and without the flag, over a grid.
"""
