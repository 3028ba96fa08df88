"""Running a Gaudi causal LM on several processes: the launcher's environment, the process group, the checks.

The distribution itself is transformers' (tensor parallelism through `from_pretrained(distributed_config=...)`)
and accelerate's (data parallelism in the Trainer); this module only starts `torch.distributed` with the backend
of the device and checks, before any model is loaded, what would otherwise fail deep inside a forward pass.
HPU-only calls go through `optimum.habana.hpu`.
"""

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import transformers
from transformers import PreTrainedConfig

from .. import hpu


# The torch.distributed backend of each device type (transformers' own map agrees).
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "hpu": "hccl"}


@dataclass(frozen=True)
class LaunchEnvironment:
    """What `torchrun` (or the DeepSpeed launcher) tells each process; one process when nothing launched it."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_environment(environ: dict[str, str] | None = None) -> LaunchEnvironment:
    """Read RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE, as set by torchrun and by the DeepSpeed launcher."""
    environ = os.environ if environ is None else environ
    world_size = int(environ.get("WORLD_SIZE", "1"))
    return LaunchEnvironment(
        rank=int(environ.get("RANK", "0")),
        local_rank=int(environ.get("LOCAL_RANK", "0")),
        world_size=world_size,
        local_world_size=int(environ.get("LOCAL_WORLD_SIZE", str(world_size))),
    )


def device_count(device_type: str) -> int | None:
    """Devices of this type on this machine; None for the CPU, where processes share the cores."""
    if device_type == "cuda":
        return torch.cuda.device_count()
    if device_type == "hpu":
        return hpu.hpu_device_count()
    return None


def check_device_count(device_type: str, local_world_size: int, count: int | None) -> None:
    """One device per process: more processes on a machine than devices is a ValueError saying what to launch."""
    if count is not None and local_world_size > count:
        raise ValueError(
            f"{local_world_size} processes were launched on this machine but it has {count} {device_type} "
            f"device(s): one process per device. Launch with --nproc-per-node {count} or fewer."
        )


def accelerator_type() -> str:
    """The device type transformers builds its device mesh on: the machine's accelerator, else the CPU."""
    accelerator = torch.accelerator.current_accelerator()
    return "cpu" if accelerator is None else accelerator.type


def init_process_group(device: torch.device, launch: LaunchEnvironment) -> torch.device:
    """Start torch.distributed with the backend of `device` and bind this process to its own device.

    Returns the device this process uses: `cuda:<local rank>`, else `device` itself (the Gaudi runtime maps each
    process to its card by local rank, as Optimum-Habana relies on). transformers and accelerate find the process
    group started and use it.
    """
    backend = BACKENDS[device.type]
    if device.type == "cuda":
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
    elif device.type == "hpu":
        hpu.register_hccl_backend()
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=launch.rank,
            world_size=launch.world_size,
            device_id=device if backend == "nccl" else None,
        )
    return device


def check_tensor_parallel_plan(model_class: type, config: PreTrainedConfig, tp_size: int) -> None:
    """transformers shards a family by its config's `base_model_tp_plan`: a family without one is a ValueError."""
    if not config.base_model_tp_plan:
        raise ValueError(
            f"The model type {config.model_type!r} ({model_class.__name__}) has no tensor-parallel plan in "
            f"transformers {transformers.__version__}, so it cannot be sharded over {tp_size} processes. Run it in "
            "one process."
        )


def check_heads_divisible(config: PreTrainedConfig, tp_size: int) -> None:
    """Every rank must get whole attention heads, query and key/value alike.

    With a remainder the attention fails at its first reshape, with a shape error that names no head count.
    """
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count is not None and count % tp_size:
            raise ValueError(
                f"Tensor parallelism over {tp_size} processes would give each one {count}/{tp_size} attention "
                f"heads: the model's {name} ({count}) must be divisible by the number of processes. Launch with a "
                f"--nproc-per-node that divides {count}."
            )


def first_error_of_ranks(error: str | None) -> str | None:
    """The first error any rank met (in rank order), given each rank's own: all ranks then stop together."""
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((message for message in errors if message is not None), None)


def gather_from_ranks(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank; `[value]` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def destroy_process_group() -> None:
    """End the process group cleanly (torch warns at exit otherwise)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
