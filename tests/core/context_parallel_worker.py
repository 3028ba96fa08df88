"""One process of the context-parallel exactness tests (`test_context_parallel.py`), launched by torchrun.

For each case ("model_type:layout:flag[:kv=K]"): a tiny model of the family trains one step on a whole batch in
this process (the reference), then on this process's part of it with `context_parallel`; the losses and the
gradients, summed over the group, are compared with the reference's. Rank 0 writes one JSON record per case.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from optimum.habana import gaudi_model_class  # noqa: E402
from optimum.habana.transformers.context_parallel import SequenceSplit  # noqa: E402
from tests.families.tiny_configs import tiny_family_config, without_dropout  # noqa: E402
from tests.helpers import count_attention_paths  # noqa: E402


LENGTH = 23  # odd: the split pads it to a multiple of the group's size


def batch(layout: str) -> dict[str, torch.Tensor]:
    """Two rows of 23 tokens; "padded": the second row left-padded by 7 (padding that real tokens would otherwise
    attend to); "packed": one row of two
    examples (10 and 13 tokens) whose position ids restart, as DataCollatorWithFlattening makes it."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 256, (2, LENGTH), generator=generator)
    labels = input_ids.clone()
    if layout == "padded":
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, :7] = 0
        labels[1, :7] = -100
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if layout == "packed":
        labels = input_ids[:1].clone()
        labels[0, 10] = -100  # the second example's first token has no previous token of its own
        position_ids = torch.cat([torch.arange(10), torch.arange(LENGTH - 10)])[None]
        return {"input_ids": input_ids[:1], "position_ids": position_ids, "labels": labels}
    return {"input_ids": input_ids, "labels": labels}


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def run_case(case: str, split: SequenceSplit) -> dict:
    model_type, layout, flag, *extra = case.split(":")
    overrides = dict(item.split("=") for item in extra)
    overrides = {"num_key_value_heads": int(overrides["kv"])} if "kv" in overrides else {}
    model_class = gaudi_model_class(model_type)
    config = tiny_family_config(
        model_type, model_class.config_class, initializer_range=0.1, **without_dropout(model_class.config_class),
        **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    model = model_class(config).train()
    flags = {"use_flash_attention": flag == "on"}
    whole = batch(layout)
    reference = model(**whole, use_cache=False, **flags)
    reference.loss.backward()
    expected = gradients(model)
    model.zero_grad()

    local = split.shard(whole)
    labelled = (local["shift_labels"] != -100).sum()
    dist.all_reduce(labelled)  # the loss's denominator: every process's labelled tokens
    with pytest.MonkeyPatch.context() as patch, count_attention_paths(patch) as counts:
        output = model(**local, context_parallel=split, num_items_in_batch=labelled, **flags)
        output.loss.backward()
    loss = output.loss.detach().clone()
    dist.all_reduce(loss)
    worst = 0.0
    for name, gradient in gradients(model).items():
        dist.all_reduce(gradient)
        worst = max(
            worst, float((gradient - expected[name]).abs().max() / expected[name].abs().max().clamp(min=1e-12))
        )
    paths = [None] * split.size
    dist.all_gather_object(paths, dict(counts))
    return {
        "loss": float(loss),
        "expected_loss": float(reference.loss.detach()),
        "gradient_difference": worst,
        "parameters": len(expected),
        "paths": paths,
    }


def main() -> None:
    output, cases = Path(sys.argv[1]), sys.argv[2].split(",")
    dist.init_process_group("gloo")
    split = SequenceSplit.over()
    records = {}
    for case in cases:
        records[case] = run_case(case, split)
    if split.rank == 0:
        output.write_text(json.dumps(records))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
