"""DeepSpeed, FSDP, data-parallel and context-parallel launches of Optimum-Habana's fine-tuning command lines, for
run_lora_clm.py.

Both are the Trainer's own (accelerate's FSDP, DeepSpeed's engine); this module checks them before anything loads,
so that a command line written for Gaudi either trains or stops with one line:

- `--deepspeed CONFIG` needs DeepSpeed installed: without it, one line says so (the Trainer would end in a
  PackageNotFoundError traceback). Launched as one process, DeepSpeed gets the one-process group it needs (it
  would otherwise look for MPI), and one line says that nothing is sharded.
- `--fsdp` shards the model over the processes of a `torchrun` launch. Launched as one process (Optimum-Habana's
  launcher prefix removed) there is nothing to shard: one line says so and the run trains unsharded. Its value is
  checked either way (the Trainer refuses an unknown option only when it gets the flag).
- `--fsdp_config` must be a readable JSON file, and its `transformer_layer_cls_to_wrap` names Optimum-Habana's
  classes (`GaudiLlamaDecoderLayer`); the decoder layers here are transformers' own (`LlamaDecoderLayer`), so such a
  name is read as that class, with one line.
- `--explain` says how each training sequence is laid out over the processes and which attention each one runs
  (`explain_training`), read from the model built on the meta device: no weights, nothing trained.
"""

import importlib.util
import json
import os
import socket
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.trainer_utils import FSDPOption

from optimum.habana.cli.generation.explain import (
    Phase,
    attention_layer_groups,
    gaudi_class_of,
    kernel_account,
    meta_model,
)
from optimum.habana.cli.generation.explain.layers import softcap_fallback
from optimum.habana.transformers.context_parallel import key_value_replication
from optimum.habana.utils import distributed
from optimum.habana.utils.distributed import LaunchEnvironment


def data_parallel_launch_problem(use_cpu: bool, launch: LaunchEnvironment) -> str | None:
    """Why the Trainer would not train data parallel over the processes launched, or None.

    On a machine without accelerator, accelerate starts the process group but trains data parallel only with
    --use_cpu: without it every process would train alone, on the same data.
    """
    if launch.is_distributed and distributed.accelerator_type() == "cpu" and not use_cpu:
        return (
            f"{launch.world_size} processes on a machine without accelerator: add --use_cpu, so that the Trainer "
            "(accelerate) trains data parallel over them on the CPU."
        )
    return None


SHARDING_OPTIONS = ("--fsdp", "--fsdp_config")


def option_value(argv: list[str], option: str) -> str | None:
    """The value given to `option` (`--option value` or `--option=value`), or None when absent."""
    for index, token in enumerate(argv):
        if token == option and index + 1 < len(argv):
            return argv[index + 1]
        if token.startswith(f"{option}="):
            return token.split("=", 1)[1]
    return None


def check_json_file(option: str, value: str) -> None:
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"{option} {value!r} is not a file; pass the path of its JSON config.")
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{option} {value!r} is not valid JSON ({error}).") from None


def prepare_sharding_arguments(argv: list[str], launch: LaunchEnvironment) -> tuple[list[str], list[str]]:
    """`argv` as the Trainer should get it, and the lines saying what the sharding options do here.

    A ValueError names the option that cannot work.
    """
    notes: list[str] = []
    deepspeed = option_value(argv, "--deepspeed")
    if deepspeed is not None:
        if importlib.util.find_spec("deepspeed") is None:
            raise ValueError(
                f"--deepspeed {deepspeed}: DeepSpeed is not installed here (pip install deepspeed). Drop --deepspeed "
                "to train without it: one process, or data parallel under torchrun --nproc-per-node N."
            )
        check_json_file("--deepspeed", deepspeed)
        if not launch.is_distributed:
            start_one_process_group()
            notes.append(
                f"--deepspeed {deepspeed}: one process here: DeepSpeed's engine runs on a one-process group and "
                "shards nothing. Launch with torchrun --nproc-per-node N (or deepspeed) to shard over N processes."
            )
    fsdp = option_value(argv, "--fsdp")
    fsdp_config = option_value(argv, "--fsdp_config")
    if fsdp_config is not None:
        check_json_file("--fsdp_config", fsdp_config)
    if fsdp is not None:
        check_fsdp_value(fsdp)
    if fsdp is not None and not launch.is_distributed:
        notes.append(
            f"--fsdp {fsdp}: one process here, so there is nothing to shard: training runs unsharded. Launch with "
            "torchrun --nproc-per-node N to shard the model with FSDP."
        )
        argv = without_options(argv, SHARDING_OPTIONS)
    return argv, notes


def check_fsdp_value(value: str) -> None:
    """The Trainer's own rule for `--fsdp` (space-separated FSDPOption names), checked also when one process drops
    the option: a value it would refuse under torchrun is refused here too, not silently ignored."""
    options = [option.value for option in FSDPOption]
    unknown = [token for token in value.split() if token not in options]
    if unknown:
        raise ValueError(
            f"--fsdp {value!r}: {unknown[0]!r} is not an FSDP option; give one or more (space-separated, quoted) of "
            f"{', '.join(options)}, e.g. --fsdp 'full_shard auto_wrap'."
        )


def start_one_process_group() -> None:
    """The variables torchrun would set for one process, so that DeepSpeed starts its group without MPI."""
    with socket.socket() as probe:  # a free port on this machine
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    defaults = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0"}
    for name, value in {**defaults, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(name, value)


def without_options(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """`argv` less each of `options` and its value."""
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        if token in options:
            skip = True
            continue
        if any(token.startswith(f"{option}=") for option in options):
            continue
        kept.append(token)
    return kept


def match_wrap_classes(training_args: Any, model: Any) -> list[str]:
    """Point FSDP's `transformer_layer_cls_to_wrap` at this model's classes; returns the lines saying what changed.

    A name that is neither a class of the model nor Optimum-Habana's `Gaudi` name of one is a ValueError listing
    the model's decoder layer classes (accelerate would stop at the first step with "Could not find").
    """
    if not training_args.fsdp:
        return []
    names = training_args.fsdp_config.get("transformer_layer_cls_to_wrap")
    if not names:
        return []
    classes = {type(module).__name__ for module in model.modules()}
    matched, notes = [], []
    for name in names:
        if name in classes:
            matched.append(name)
        elif name.startswith("Gaudi") and name.removeprefix("Gaudi") in classes:
            matched.append(name.removeprefix("Gaudi"))
            notes.append(
                f"--fsdp_config transformer_layer_cls_to_wrap {name}: the decoder layers here are transformers' "
                f"{name.removeprefix('Gaudi')}; wrapping those."
            )
        else:
            layers = sorted(name for name in classes if name.endswith("DecoderLayer"))
            raise ValueError(
                f"--fsdp_config transformer_layer_cls_to_wrap {name}: the model has no such class; its decoder "
                f"layers are {', '.join(layers)}."
            )
    training_args.fsdp_config["transformer_layer_cls_to_wrap"] = matched
    training_args.fsdp_plugin_args["transformer_cls_names_to_wrap"] = ",".join(matched)
    return notes


def explain_training(
    config: PreTrainedConfig,
    *,
    context_parallel_size: int,
    world_size: int,
    max_seq_length: int,
    use_flash_attention: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> str:
    """The lines --explain prints; `config` is the checked model's (a family that cannot be split was refused)."""
    size = context_parallel_size
    model = meta_model(gaudi_class_of(config.model_type, f"The model ({config.model_type})"), config)
    groups = attention_layer_groups(model)
    padded = -(-max_seq_length // size) * size
    lines = [f"Processes: {world_size}; context parallel size {size}; {world_size // size} data-parallel replica(s)."]
    if size == 1:
        lines.append(f"Sequences: whole on each process (up to {max_seq_length} tokens).")
    else:
        lines.append(
            f"Sequences: up to {max_seq_length} tokens, padded to a multiple of {size} ({padded}); each process holds "
            f"{padded // size} consecutive positions of each sequence for the embeddings, norms, MLPs, LM head and "
            "loss (the labels shifted before the cut), and inside each attention call the whole sequence for its "
            "share of the heads (an all-to-all before and after the call)."
        )
    for group in groups:
        heads, key_value_heads, head_dim, value_dim, _ = group.geometry
        if size > 1:
            factor = key_value_replication(heads, key_value_heads, size)
            repeat = f", each key/value head repeated x{factor}" if factor > 1 else ""
            share = f"{heads // size} of {heads} query heads and {key_value_heads * factor // size} of {key_value_heads} key/value heads{repeat}"
        else:
            share = f"{heads} query heads and {key_value_heads} key/value heads"
        phase = Phase("training", padded, (padded, padded), padded=True, from_empty_cache=True)
        if not use_flash_attention:
            attention = "the default matmul-softmax attention (use_flash_attention off)"
        elif group.softcap is not None:  # as the attention decides it (`fused_path_refusal`)
            attention = f"the default matmul-softmax attention ({softcap_fallback(group.softcap)}; one warning)"
        else:
            attention = kernel_account(group, phase, device, dtype, 1, masked=False, compiled=False)
        lines.append(
            f"{group.label}: per process {share} (heads of {head_dim}"
            + (f", values of {value_dim}" if value_dim != head_dim else "")
            + f") over {padded} positions; attention: {attention}."
        )
    return "\n".join(lines)
