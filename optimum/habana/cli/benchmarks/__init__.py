"""The benchmark scripts: each measurement in a fresh process (`workers`), on real or synthetic models (`models`),
reported in shared table formats (`tables`). One subpackage per benchmark: `inference` (benchmark_flash_attention.py),
`training` (benchmark_training.py, benchmark_packed_step.py's models), `continuous_batching`
(benchmark_continuous_batching.py).
"""
