"""Runs a GGUF conversion, or run_lora_clm.py, in a subprocess whose conversion is slow, so a test can signal it.

    python tests/fault_driver.py resolve MARKER MODEL            # resolve_model(MODEL)
    python tests/fault_driver.py script MARKER SCRIPT ARGS...    # run SCRIPT as __main__ with ARGS

The real conversion of a GGUF file takes ~20 s and 1.5 GB; this one writes a config.json and a weights file into
the staging folder, creates MARKER (the test's signal that the conversion is under way) and sleeps, so that the
test can send SIGINT or SIGKILL at a known point. FAULT_DRIVER_FAST=1 skips the sleep (the rerun).
"""

import os
import runpy
import sys
import time
from pathlib import Path

from optimum.habana.utils import model_loading


MARKER = Path(sys.argv[2])


def slow_convert(gguf_path: Path, output_dir: Path) -> None:
    (output_dir / "config.json").write_text('{"model_type": "llama"}')
    (output_dir / "model.safetensors").write_bytes(os.urandom(1 << 16))
    if os.environ.get("FAULT_DRIVER_FAST") != "1":
        MARKER.write_text(str(output_dir))
        time.sleep(120)


if __name__ == "__main__":
    model_loading._convert_gguf = slow_convert
    mode, _, target, *rest = sys.argv[1:]
    if mode == "resolve":
        print(model_loading.resolve_model(target).path)
    else:
        sys.argv = [target, *rest]
        runpy.run_path(target, run_name="__main__")
