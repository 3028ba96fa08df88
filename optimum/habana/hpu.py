"""Everything that calls the Gaudi software (`habana_frameworks`): the one HPU-only module.

`habana_frameworks` ships with the Gaudi software stack, not PyPI, so every import is lazy and optional:
`import optimum.habana` works, silently, on machines without it.
"""

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Literal

import torch


# torch.compile's backend for Gaudi, registered by habana_frameworks.
COMPILE_BACKEND = "hpu_backend"


@dataclass(frozen=True)
class HPUKernel:
    """Habana's FusedSDPA and the calling convention of the installed Gaudi software."""

    apply: Any
    sdp_kernel: Any
    # "1.18": (..., scale, softmax_mode, recompute_mode, valid_seq_len, seq_padding_type), recompute per call.
    # "1.16": (..., scale, softmax_mode), recompute through the sdp_kernel context manager.
    # "1.13": (..., scale), recompute through the context manager, no fast softmax.
    signature: Literal["1.18", "1.16", "1.13"]
    # Later 1.18-style kernels append (return_dropout_mask, return_attn_probs, window_size, sink): the recompute
    # variant then takes a sliding window and attention sinks.
    takes_sinks: bool = False


# What hpu_kernel() imports, in order; `missing_kernel` names the first one missing.
KERNEL_IMPORTS = (
    ("habana_frameworks.torch.hpu", "sdp_kernel"),
    ("habana_frameworks.torch.hpex.kernels", "FusedSDPA"),
)


@functools.cache
def missing_kernel() -> str:
    """Why hpu_kernel() found no kernel: the Gaudi software absent, or installed without FusedSDPA or sdp_kernel."""
    try:
        import habana_frameworks.torch  # noqa: F401
    except ImportError as error:
        return f"habana_frameworks cannot be imported ({error})"
    for module, name in KERNEL_IMPORTS:
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as error:
            return f"the installed Gaudi software has no {module}.{name} ({error})"
    return "habana_frameworks' FusedSDPA cannot be used"


@functools.cache
def hpu_kernel() -> HPUKernel | None:
    """Import FusedSDPA once, and read which argument list the installed Gaudi software takes."""
    try:
        sdp_kernel, FusedSDPA = (getattr(importlib.import_module(module), name) for module, name in KERNEL_IMPORTS)
    except (ImportError, AttributeError):  # `missing_kernel` says which
        return None
    parameters = inspect.signature(FusedSDPA.forward).parameters
    if "recompute_mode" in parameters:
        signature = "1.18"
    elif "softmax_mode" in parameters:
        signature = "1.16"
    else:
        signature = "1.13"
    takes_sinks = signature == "1.18" and "sink" in parameters and "window_size" in parameters
    return HPUKernel(apply=FusedSDPA.apply, sdp_kernel=sdp_kernel, signature=signature, takes_sinks=takes_sinks)


def on_hpu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "hpu"


def is_hpu_available() -> bool:
    """True when the Gaudi software is installed and sees a card (importing it registers the `hpu` device)."""
    try:
        import habana_frameworks.torch.hpu as hthpu
    except ImportError:
        return False
    return bool(hthpu.is_available())


def hpu_memory_stats() -> dict[str, int]:
    import habana_frameworks.torch.hpu as hthpu

    stats = hthpu.memory_stats()
    readings = {"allocated": int(stats["InUse"]), "max_allocated": int(stats["MaxInUse"])}
    if "Limit" in stats:
        readings["total"] = int(stats["Limit"])
    return readings


def reset_hpu_peak_memory() -> None:
    import habana_frameworks.torch.hpu as hthpu

    hthpu.reset_peak_memory_stats()


def synchronize_hpu() -> None:
    import habana_frameworks.torch.hpu as hthpu

    hthpu.synchronize()


def wrap_in_hpu_graph(
    model: torch.nn.Module, prompt_in_graph: bool = True, max_graphs: int | None = None
) -> torch.nn.Module:
    """Record the model's launches once and replay them: the HPU's answer to per-op launch overhead.

    Without `prompt_in_graph` (Optimum-Habana's --limit_hpu_graphs) prompts run eagerly and only decode steps
    (one new token per row) replay graphs: each prompt shape would otherwise record, and keep, a graph of its own.
    `max_graphs` (Optimum-Habana's --max_graphs) bounds the graphs kept, one per input shape.
    """
    from habana_frameworks.torch.hpu import wrap_in_hpu_graph as wrap

    eager_forward = model.forward
    model = wrap(model) if max_graphs is None else wrap(model, max_graphs=max_graphs)
    if not prompt_in_graph:
        graph_forward = model.forward

        def forward(*args, **kwargs):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            embeds = kwargs.get("inputs_embeds")  # a prompt given as embeddings (generate()'s inputs_embeds)
            is_prompt = (input_ids is not None and input_ids.shape[-1] > 1) or (
                embeds is not None and embeds.shape[-2] > 1
            )
            return eager_forward(*args, **kwargs) if is_prompt else graph_forward(*args, **kwargs)

        model.forward = forward
    return model


def hpu_device_count() -> int:
    """Gaudi cards visible to this process (0 without the Gaudi software)."""
    try:
        import habana_frameworks.torch.hpu as hthpu
    except ImportError:
        return 0
    return int(hthpu.device_count())


def register_hccl_backend() -> None:
    """Importing Habana's distributed module registers the `hccl` backend with torch.distributed."""
    import habana_frameworks.torch.distributed.hccl  # noqa: F401
