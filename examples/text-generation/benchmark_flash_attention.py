#!/usr/bin/env python
"""The default-vs-flash table: throughput, prefill time and peak memory with and without --use_flash_attention.

    python examples/text-generation/benchmark_flash_attention.py                      # embedded SmolLM2, small grid
    python examples/text-generation/benchmark_flash_attention.py --model_name_or_path llama2-7b-attn \
        --batch_sizes 1 --max_input_tokens 4096 8192 16384 --max_new_tokens 1 --warmup 0 --n_iterations 1

Each path of each row runs in a fresh process; the Markdown table goes to stdout, --output_dir gets results.json
and results.csv (and --plot a PNG). docs/benchmarks.md explains the columns and shows measured tables.
The code lives in `optimum.habana.cli.benchmarks.inference.command`.
"""

import sys
from collections.abc import Sequence

from optimum.habana.cli.benchmarks.inference.arguments import build_parser, parse_arguments
from optimum.habana.cli.benchmarks.inference.command import run


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    return run(parse_arguments(parser, argv), parser)


if __name__ == "__main__":
    sys.exit(main())
