"""Latent attention's compressed cache, handed to the Gaudi attention as it lies (`kernels/latent.py` says why).

transformers' DeepSeek V2/V3 and the 15 families made from them cache the compressed latent and, in their own
forward, expand the whole cache into every head's keys and values (`self.expand_kv(...)`) right before the
attention call. In a Gaudi model that expansion is left to the attention: each such module's `expand_kv` is
replaced, on the instance, by `KeepCompressed`, which hands the latent and the rotary key on unchanged. The Gaudi
attention then either absorbs the up-projection into the step (a decode step with `use_flash_attention`) or calls
the family's own `expand_kv` and continues as for any family, so every other path computes what stock computes.

A module qualifies by its code, read with `ast`: its `expand_kv` is DeepSeek-V3's, statement for statement, and its
forward hands that method's results to the attention function as key and value, reading nothing else of them but
their shapes. A module that fails either test keeps its own `expand_kv`.
"""

import ast
import functools

import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from ..kernels.latent import absorbs
from .families.source_facts import interface_lookup_names_of, method


class KeepCompressed:
    """A Gaudi model's stand-in for a latent attention module's `expand_kv`: returns the cache's latent `[B, 1, kv, L]`
    and rotary key `[B, 1, kv, rope]` as they are. (A plain object, so that the model pickles and deep-copies.)"""

    def __call__(self, latent: torch.Tensor, rotary_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return latent, rotary_key


def keep_latent_compressed(model: nn.Module) -> None:
    """Install `KeepCompressed` on every module of `model` whose class qualifies (module docstring)."""
    for module in model.modules():
        if hands_expanded_latent(type(module)):
            module.expand_kv = KeepCompressed()


def receives_compressed_latent(module: nn.Module) -> bool:
    """Whether this attention call's key and value are the compressed cache, not keys and values."""
    return isinstance(vars(module).get("expand_kv"), KeepCompressed)


def expanded(module: nn.Module, latent: torch.Tensor, rotary_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values the family's own code would have passed: its class's `expand_kv`."""
    return type(module).expand_kv(module, latent, rotary_key)


def absorbable_up_projection(module: nn.Module, query: torch.Tensor, latent: torch.Tensor) -> torch.Tensor | None:
    """`kv_b_proj.weight` where absorbing it is exact and cheaper for this call, else None.

    Exact: `kv_b_proj` is a plain `nn.Linear` without bias, hooks or an overridden forward, its weight on the
    query's device (an adapter, a quantized or an offloaded layer computes something else than its `weight`: the
    family's expansion then runs it). Cheaper: `kernels.latent.absorbs`, for this call's query rows."""
    projection = getattr(module, "kv_b_proj", None)
    plain = (
        type(projection) is nn.Linear
        and projection.bias is None
        and "forward" not in vars(projection)
        and not (projection._forward_hooks or projection._forward_pre_hooks)
        and projection.weight.device == query.device
    )
    if not plain:
        return None
    rope = query.shape[-1] - module.qk_nope_head_dim
    if not absorbs(query.shape[2], latent.shape[-1], rope, module.qk_nope_head_dim, module.v_head_dim):
        return None
    return projection.weight


@functools.cache
def hands_expanded_latent(cls: type) -> bool:
    """Whether `cls`'s forward passes transformers' latent expansion (`self.expand_kv(...)`, DeepSeek-V3's) to its
    attention function as key and value, and reads nothing else of them but their shapes."""
    if not issubclass(cls, nn.Module) or "expand_kv" not in dir(cls):
        return False
    own, reference = method(cls, "expand_kv"), method(DeepseekV3Attention, "expand_kv")
    if own is None or reference is None or _statements(own[1]) != _statements(reference[1]):
        return False
    located = method(cls, "forward")
    if located is None:
        return False
    forward, lookups = located[1], interface_lookup_names_of(cls)
    expansions = [
        node
        for node in ast.walk(forward)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _calls_self(node.value, "expand_kv")
    ]
    if len(expansions) != 1 or not _two_names(expansions[0].targets):
        return False
    key, value = (name.id for name in expansions[0].targets[0].elts)
    allowed: set[int] = set()  # the Name nodes that read key or value as the attention call's inputs or for a shape
    attention_calls = 0
    for node in ast.walk(forward):
        if isinstance(node, ast.Attribute) and node.attr == "shape" and isinstance(node.value, ast.Name):
            allowed.add(id(node.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in lookups:
            arguments = node.args[2:4]
            if [getattr(argument, "id", None) for argument in arguments] != [key, value]:
                return False
            allowed |= {id(argument) for argument in arguments}
            attention_calls += 1
    uses = [node for node in ast.walk(forward) if isinstance(node, ast.Name) and node.id in (key, value)]
    stores = [node for node in uses if not isinstance(node.ctx, ast.Load)]
    loads = [node for node in uses if isinstance(node.ctx, ast.Load)]
    return attention_calls > 0 and len(stores) == 2 and all(id(node) in allowed for node in loads)


def _statements(function: ast.FunctionDef) -> str:
    """A method's statements, without its docstring or comments, as a comparable string."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.dump(ast.Module(body=body, type_ignores=[]), annotate_fields=False)


def _calls_self(call: ast.Call, name: str) -> bool:
    target = call.func
    return isinstance(target, ast.Attribute) and target.attr == name and getattr(target.value, "id", None) == "self"


def _two_names(targets: list[ast.expr]) -> bool:
    return (
        len(targets) == 1
        and isinstance(targets[0], ast.Tuple)
        and len(targets[0].elts) == 2
        and all(isinstance(element, ast.Name) for element in targets[0].elts)
    )
