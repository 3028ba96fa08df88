"""Support code of the example scripts (`examples/`): arguments, reports, the benchmark loop, fine-tuning data.

Not part of the library's core: it needs the `examples` extra (`pip install optimum-gaudi-flash[examples]`), which
brings `datasets`, `peft` and `tqdm`. The scripts stay short and read top to bottom; what tests need to reach
lives here.
"""
