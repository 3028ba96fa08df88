"""Multi-process runs of `examples/text-generation/run_generation.py`: the arguments, the start, the loading, the stats.

Under `torchrun --nproc-per-node N` (or the DeepSpeed launcher) the model is sharded over the N processes with
transformers' tensor parallelism (`from_pretrained(distributed_config=DistributedConfig(tp_size=N))`), or with
DeepSpeed's AutoTP under `--use_deepspeed`. Every rank generates the same tokens; rank 0 prints and writes them,
with every rank's memory. See docs/multi_device.md.
"""

import importlib.util
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoConfig, DistributedConfig

from optimum.habana.transformers.models import family_problem, gaudi_model_class
from optimum.habana.utils import distributed
from optimum.habana.utils.distributed import LaunchEnvironment
from optimum.habana.utils.model_loading import ModelResolutionError, resolve_model
from optimum.habana.utils.pretrained import LoadedModel, load_model_and_tokenizer


PARALLEL_STRATEGIES = ("auto", "tp", "none")


GB = 1024**3


@dataclass
class ParallelArguments:
    _argument_group_name = "multi-device"

    parallel_strategy: str = field(
        default="auto",
        metadata={
            "choices": PARALLEL_STRATEGIES,
            "help": "How several processes (torchrun --nproc-per-node N) share the model. tp: tensor parallelism, "
            "each process holds 1/N of every sharded weight (transformers' plan of the family, or DeepSpeed's "
            "AutoTP with --use_deepspeed). auto: tp when launched with N > 1 processes. none: one process only.",
        },
    )
    use_deepspeed: bool = field(
        default=False,
        metadata={
            "help": "Shard the model with DeepSpeed inference (deepspeed.init_inference, AutoTP, no kernel "
            "injection) instead of transformers' tensor parallelism. Needs `pip install deepspeed`."
        },
    )
    local_rank: int = field(
        default=-1,
        metadata={
            "help": "Set by the DeepSpeed launcher (`deepspeed --num_gpus N`); this script reads the LOCAL_RANK "
            "environment variable, which both launchers set."
        },
    )


@dataclass(frozen=True)
class ParallelRun:
    """How this process takes part: the launch, the strategy ("none", "tp" or "deepspeed") and its device."""

    launch: LaunchEnvironment
    strategy: str
    device: torch.device
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.launch.is_main


def validate_parallel_arguments(arguments: ParallelArguments, launch: LaunchEnvironment) -> None:
    """The checks that need no device and no model; a ValueError names the flag and what to do."""
    if arguments.parallel_strategy == "none" and launch.is_distributed:
        raise ValueError(
            f"--parallel_strategy none runs the whole model in each of the {launch.world_size} processes launched: "
            "use --parallel_strategy tp (or auto), or launch one process."
        )
    if arguments.use_deepspeed and arguments.parallel_strategy == "none":
        raise ValueError("--use_deepspeed shards the model (tensor parallel): drop --parallel_strategy none.")
    if arguments.use_deepspeed and importlib.util.find_spec("deepspeed") is None:
        raise ValueError("--use_deepspeed: DeepSpeed is not installed. `pip install deepspeed`, or drop the flag.")


def start(arguments: ParallelArguments, device: torch.device, launch: LaunchEnvironment) -> ParallelRun:
    """Check the launch against the devices and start the process group; one process needs neither."""
    if not launch.is_distributed:
        if arguments.use_deepspeed or arguments.parallel_strategy == "tp":
            flag = "--use_deepspeed" if arguments.use_deepspeed else "--parallel_strategy tp"
            print(
                f"Note: {flag} with one process: nothing to shard, the model runs whole. Launch with "
                "torchrun --nproc-per-node N to shard it.",
                file=sys.stderr,
            )
        return ParallelRun(launch, "none", device)
    distributed.check_device_count(device.type, launch.local_world_size, distributed.device_count(device.type))
    strategy = "deepspeed" if arguments.use_deepspeed else "tp"
    mesh_device = distributed.accelerator_type()
    if strategy == "tp" and device.type != mesh_device:
        raise ValueError(
            f"--device {device.type}: transformers' tensor parallelism shards the model over this machine's "
            f"accelerator ({mesh_device}). Drop --device (or pass --device {mesh_device})."
        )
    device = distributed.init_process_group(device, launch)
    return ParallelRun(launch, strategy, device, distributed.BACKENDS[device.type])


def load_model(model_name_or_path: str | None, *, dtype: torch.dtype, run: ParallelRun) -> LoadedModel:
    """Load the model whole, or sharded over the processes of `run`.

    A .gguf path (the default model included) is converted once: by the first process of each machine while the
    others wait, then every process loads the converted checkpoint. Checks that would otherwise fail inside the
    first forward pass (a family without a plan, head counts the processes do not divide) come before loading.
    """
    if run.strategy == "none":
        return load_model_and_tokenizer(model_name_or_path, dtype=dtype, device=run.device)
    resolve_once_per_machine(model_name_or_path, run.launch)
    config = AutoConfig.from_pretrained(resolve_model(model_name_or_path).path)
    if family_problem(config.model_type) is None:  # else load_model_and_tokenizer says why there is no class
        model_class = gaudi_model_class(config.model_type)
        if run.strategy == "tp":
            distributed.check_tensor_parallel_plan(model_class, config, run.launch.world_size)
        distributed.check_heads_divisible(config, run.launch.world_size)
    if run.strategy == "tp":
        tensor_parallel = DistributedConfig(tp_size=run.launch.world_size)
        return load_model_and_tokenizer(
            model_name_or_path, dtype=dtype, device=run.device, distributed_config=tensor_parallel
        )
    loaded = load_model_and_tokenizer(model_name_or_path, dtype=dtype, device=run.device)
    loaded.model = deepspeed_inference(loaded.model, dtype, run)
    return loaded


def resolve_once_per_machine(model_name_or_path: str | None, launch: LaunchEnvironment) -> None:
    """The first process of each machine resolves (converts a .gguf, downloads); the others then find its cache.

    A resolution error stops every process, with the same message.
    """
    error = None
    if launch.local_rank == 0:
        try:
            resolve_model(model_name_or_path)
        except ModelResolutionError as raised:
            error = str(raised)
    error = distributed.first_error_of_ranks(error)
    if error is not None:
        raise ModelResolutionError(error)


def deepspeed_inference(model: torch.nn.Module, dtype: torch.dtype, run: ParallelRun) -> torch.nn.Module:
    """Shard a loaded model with DeepSpeed's AutoTP; the module it returns generates as the model did."""
    import deepspeed  # optional dependency, checked by validate_parallel_arguments

    if run.device.type == "cpu":
        # DeepSpeed JIT-builds a shared-memory all-reduce for CPU runs; with deepspeed 0.19.8 and torch 2.13 it
        # crashed both processes (SIGSEGV) on the first generate. Marked incompatible, it is not built, and
        # DeepSpeed all-reduces through the gloo process group instead.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=run.backend)  # adopts the process group started here
    engine = deepspeed.init_inference(
        model,
        tensor_parallel={"tp_size": run.launch.world_size},
        dtype=dtype,
        replace_with_kernel_inject=False,  # keep transformers' modules, so the Gaudi attention and its flags run
    )
    return engine.module


def rank_stats(run: ParallelRun, memory: dict[str, int], model_size_bytes: int) -> dict[str, Any]:
    """Every rank's memory, gathered on every rank (a collective: all ranks call it)."""
    mine = {
        "rank": run.launch.rank,
        "device": str(run.device),
        "memory_allocated_bytes": memory["allocated"],
        "max_memory_allocated_bytes": memory["max_allocated"],
        "model_size_bytes": model_size_bytes,
    }
    return {
        "world_size": run.launch.world_size,
        "parallel_strategy": run.strategy,
        "backend": run.backend,
        "per_rank": distributed.gather_from_ranks(mine),
    }


def format_run(run: ParallelRun) -> str:
    """One header line saying how the processes share the model."""
    if run.strategy == "none":
        return "Processes: 1 (the whole model in this process)"
    how = "DeepSpeed AutoTP" if run.strategy == "deepspeed" else "transformers' tensor-parallel plan"
    return f"Processes: {run.launch.world_size}, tensor parallel ({how}), backend {run.backend}; rank 0 prints"


def format_rank_stats(stats: dict[str, Any]) -> str:
    """A line per rank: its memory and the size of its part of the model."""
    lines = ["Per rank (memory measured as above; model size = this rank's part of the weights):"]
    for rank in stats["per_rank"]:
        lines.append(
            f"  rank {rank['rank']} ({rank['device']}): memory {_gb(rank['memory_allocated_bytes'])}, "
            f"max {_gb(rank['max_memory_allocated_bytes'])}, model size {_gb(rank['model_size_bytes'])}"
        )
    return "\n".join(lines)


def silence_other_ranks(launch: LaunchEnvironment) -> None:
    """Ranks other than 0 print nothing: rank 0 prints the same texts, stats and usage errors.

    An unexpected exception on another rank still reaches the terminal, with its rank.
    """
    if launch.is_main:
        return
    terminal = sys.stderr
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process

    def report(kind: type[BaseException], value: BaseException, trace: Any) -> None:
        print(f"[rank {launch.rank}] ", end="", file=terminal)
        traceback.print_exception(kind, value, trace, file=terminal)

    sys.excepthook = report


def finish(run: ParallelRun) -> None:
    if run.strategy != "none":
        distributed.destroy_process_group()


def _gb(count: int) -> str:
    return f"{count / GB:.3f} GiB" if count >= GB / 100 else f"{count / 1024**2:.2f} MiB"
