"""`run_generation.py --explain`, its graph part: whether the prompt's forward and a decode step run as one graph.

Graph breaks depend on the code a forward runs (the family, the flags, the padding, the KV cache), not on the
weights or the sizes, so a two-layer model of the same family with tiny sizes and random weights runs the command's
generate() on the CPU here, and each phase's first forward is traced by dynamo (nothing is compiled): what
torch.compile would capture, and what an HPU or CUDA graph records, since those must not read the host either.
"""

import copy
from typing import Any

import torch
from transformers import PreTrainedConfig

from optimum.habana.transformers.models import gaudi_model_class
from optimum.habana.utils.graph_capture import CompileCounter, GraphReport

from ..arguments import ScriptArguments
from ..capture import compile_backend, eager_decode_reason, is_captured
from ..generation_config import KVCacheSupply, build_generation_config, kv_cache_layout


# The sizes of the traced copy: any family's layers keep their structure (windows, soft-capping, scales, experts).
TINY_SIZES = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}
TRACED_LAYERS = 2


def graph_accounts(
    arguments: ScriptArguments, config: PreTrainedConfig, inputs: dict[str, torch.Tensor], device: torch.device
) -> list[str]:
    """One line per phase: "one graph", or the graphs and the first break's reason; or what runs uncaptured."""
    execution = arguments.execution
    if not is_captured(execution, device):
        if execution.use_hpu_graphs:
            return [
                f"eager: nothing is captured (--use_hpu_graphs: HPU graphs exist on Gaudi only, not on {device.type}; "
                "--torch_compile compiles the prompt and the decode step here)"
            ]
        return ["eager: nothing is captured (--torch_compile compiles the prompt and the decode step)"]
    reports = traced_phases(arguments, config, inputs)
    lines = []
    for phase, report in reports.items():
        if execution.torch_compile:
            eager = eager_decode_reason(arguments.workload.num_beams) if phase == "decode step" else None
            captured = f"torch.compile, {compile_backend(execution, device)}"
        else:
            eager = (
                "--limit_hpu_graphs records decode steps only"
                if phase == "prompt" and execution.limit_hpu_graphs
                else None
            )
            captured = "an HPU graph"
        lines.append(f"{phase}: runs eagerly ({eager})" if eager else f"{phase}: {report.describe()} ({captured})")
    lines.append(f"traced with dynamo on the CPU, a {TRACED_LAYERS}-layer {config.model_type} with tiny sizes")
    return lines


def traced_phases(
    arguments: ScriptArguments, config: PreTrainedConfig, inputs: dict[str, torch.Tensor]
) -> dict[str, GraphReport]:
    """generate() of two new tokens on a tiny copy of the model, the first forward of each phase traced."""
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = gaudi_model_class(config.model_type)(tiny_copy(config)).eval()
    reports: dict[str, GraphReport] = {}
    eager = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        phase = "prompt" if tokens.shape[1] > 1 else "decode step"
        if phase in reports or torch.compiler.is_compiling():
            return eager(*args, **kwargs)
        torch._dynamo.reset()
        with CompileCounter() as counter:
            output = torch.compile(eager, backend="eager", dynamic=False)(*args, **kwargs)
        reports[phase] = counter.report
        return output

    model.forward = forward
    generation_config = build_generation_config(model.generation_config, arguments, 0, device)
    generation_config.compile_config = None  # traced here, phase by phase, instead
    generation_config.max_new_tokens = generation_config.min_new_tokens = 2
    layout = kv_cache_layout(arguments, device)
    cache = KVCacheSupply(layout, model.config, max_cache_len=inputs["input_ids"].shape[1] + 2)()
    small = {
        name: tensor % TINY_SIZES["vocab_size"] if name == "input_ids" else tensor for name, tensor in inputs.items()
    }
    with torch.no_grad():
        model.generate(**small, generation_config=generation_config, **({"past_key_values": cache} if cache else {}))
    torch._dynamo.reset()
    return reports


def tiny_copy(config: PreTrainedConfig) -> PreTrainedConfig:
    """`config` with tiny sizes and two layers, one of each layer type where the model mixes them."""
    tiny = copy.deepcopy(config)
    for name, value in TINY_SIZES.items():
        if hasattr(tiny, name):
            setattr(tiny, name, value)
    tiny.num_hidden_layers = TRACED_LAYERS
    layer_types = getattr(tiny, "layer_types", None)
    if layer_types:
        kinds = list(dict.fromkeys(layer_types))[:TRACED_LAYERS]
        tiny.layer_types = (kinds * TRACED_LAYERS)[:TRACED_LAYERS]
    return tiny


__all__ = ["graph_accounts", "tiny_copy", "traced_phases"]
