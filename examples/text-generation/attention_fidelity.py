#!/usr/bin/env python
"""How far is each attention path from the exact answer: the fidelity table of docs/fidelity.md.

    python examples/text-generation/attention_fidelity.py --output_dir fidelity --threads 1   # ~40 min on this CPU
    python examples/text-generation/attention_fidelity.py --quick                            # 1-2 minutes

The fused path (--use_flash_attention) and the default path, called through the library's attention function and
run through the embedded SmolLM2, against float64: max and mean absolute error of the attention output (lengths
512-16k, head dims 64-256, GQA ratios 1-8, left-padded batches, attn_softmax_bf16, Gaudi's fast softmax) and of the
logits, plus the perplexity on the shipped long text, in fp32 and bf16. --device cuda/hpu fills the device columns.
The code lives in `optimum.habana.cli.evaluation.fidelity.command`.
"""

import sys
from collections.abc import Sequence

from optimum.habana.cli.evaluation.fidelity.command import build_parser, parse_arguments, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    return run(parse_arguments(parser, argv), parser, argv)


if __name__ == "__main__":
    sys.exit(main())
