"""Run by test_multi_device.py: `torchrun --standalone --nproc-per-node 2 -m tests.generation.tensor_parallel_worker`.

Each rank loads every checkpoint of CHECKPOINT_ROOT twice, whole and tensor-parallel, generates greedily with
and without the flag on batch 1 and on a left-padded batch, and writes what it saw to OUTPUT_DIR/rank<r>.json:
whether the tokens match, which attention path ran with how many heads, the size of its weights, and how a .gguf
path was resolved (converted once per machine, or one error for all ranks).
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, DistributedConfig

from optimum.habana.cli.generation import multi_process
from optimum.habana.transformers import attention
from optimum.habana.transformers.models import GAUDI_CAUSAL_LM_CLASSES
from optimum.habana.utils import distributed, model_loading
from optimum.habana.utils.devices import model_size_bytes
from tests.helpers import left_padded_batch


BATCHES = {"batch1": left_padded_batch([7]), "padded": left_padded_batch([5, 9, 3])}


def record_attention_calls(calls: list[tuple[str, int]]) -> None:
    """Note every attention call's path and the query's head count (the local heads under TP)."""
    fused, default = attention.fused_sdpa, attention.matmul_softmax_attention

    def fused_spy(query, *args, **kwargs):
        calls.append(("fused", query.shape[1]))
        return fused(query, *args, **kwargs)

    def default_spy(query, *args, **kwargs):
        calls.append(("default", query.shape[1]))
        return default(query, *args, **kwargs)

    attention.fused_sdpa = fused_spy
    attention.matmul_softmax_attention = default_spy


def compare_families(checkpoint_root: Path, tp_size: int) -> dict:
    results = {}
    calls: list[tuple[str, int]] = []
    record_attention_calls(calls)
    for folder in sorted(path for path in checkpoint_root.iterdir() if path.is_dir()):
        model_class = GAUDI_CAUSAL_LM_CLASSES[AutoConfig.from_pretrained(folder).model_type]
        whole = model_class.from_pretrained(folder, dtype=torch.float32).eval()
        sharded = model_class.from_pretrained(
            folder, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=tp_size)
        ).eval()
        family = {"model_size_bytes": model_size_bytes(whole), "rank_model_size_bytes": model_size_bytes(sharded)}
        for flash in (False, True):
            for name, batch in BATCHES.items():
                options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "use_flash_attention": flash}
                expected = whole.generate(**batch, **options)
                calls.clear()
                tokens = sharded.generate(**batch, **options)
                family[f"{name}-{'flash' if flash else 'default'}"] = {
                    "same_tokens": torch.equal(tokens, expected),
                    "paths": sorted({path for path, _ in calls}),
                    "heads": sorted({heads for _, heads in calls}),
                }
        results[folder.name] = family
    return results


def resolve_gguf(folder: Path, launch: distributed.LaunchEnvironment) -> dict:
    """A .gguf path under TP: converted once per machine, then found in the cache; a bad file stops every rank."""
    conversions = folder / "conversions.txt"

    def convert(gguf_path: Path, output_dir: Path) -> None:  # stands in for the ~10 s de-quantization
        with conversions.open("a") as file:
            file.write(f"{launch.rank}\n")
        (output_dir / "config.json").write_text("{}")

    model_loading._convert_gguf = convert
    multi_process.resolve_once_per_machine(str(folder / "model.gguf"), launch)
    resolved = model_loading.resolve_model(str(folder / "model.gguf"))
    try:
        multi_process.resolve_once_per_machine(str(folder / "other.gguf"), launch)
        error = None
    except model_loading.ModelResolutionError as raised:
        error = str(raised)
    distributed.barrier()
    return {
        "path": str(resolved.path),
        "converted_now": resolved.converted,
        "conversions_by_rank": conversions.read_text().split(),
        "error": error,
    }


def main(checkpoint_root: Path, gguf_folder: Path, output_dir: Path) -> None:
    torch.set_num_threads(1)
    launch = distributed.launch_environment()
    distributed.init_process_group(torch.device("cpu"), launch)
    results = {
        "families": compare_families(checkpoint_root, launch.world_size),
        "gguf": resolve_gguf(gguf_folder, launch),
    }
    (output_dir / f"rank{launch.rank}.json").write_text(json.dumps(results, indent=1))
    distributed.destroy_process_group()


if __name__ == "__main__":
    main(*(Path(argument) for argument in sys.argv[1:4]))
