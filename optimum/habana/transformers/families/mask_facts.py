"""What a family's forwards do with the attention mask, read from their code: which of transformers' mask builders
they call, and what else reads the mask (a placeholder mask would change what such a use computes)."""

import ast
import functools

from .source_facts import _is_self, _local_sources, _source_names, method


MASK_BUILDERS = frozenset(
    {
        "create_causal_mask",
        "create_sliding_window_causal_mask",
        "create_chunked_causal_mask",
        "create_bidirectional_mask",
        "create_masks_for_generate",
        "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING",
    }
)


@functools.cache
def mask_uses(cls: type, allowed_calls: frozenset[str]) -> tuple[str, ...]:
    """The uses of `attention_mask` in `cls`'s forward other than handing it to one of `allowed_calls` (callee names:
    `create_causal_mask`, `attention_interface`, `self.self_attn`), a dict of arguments one of them receives, or
    testing it for None;
    each as source text. A placeholder mask would change what such a use computes."""
    located = method(cls, "forward")
    if located is None:
        return ()
    function = located[1]
    # A local name bound to one of them, not to its result: `mask_function = create_causal_mask if ... else ...`.
    aliases = {
        name
        for name, read in _local_sources(function).items()
        if read & set(allowed_calls) and "attention_mask" not in read
    }
    allowed_calls = set(allowed_calls) | aliases
    handed_on: set[int] = set()
    passed_names: set[str] = set()  # local names read in the arguments of those calls (`**mask_kwargs`)
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and _callee(node) in allowed_calls | {"isinstance"}:
            for argument in list(node.args) + [keyword.value for keyword in node.keywords]:
                handed_on |= {id(child) for child in ast.walk(argument)}
                passed_names |= {child.id for child in ast.walk(argument) if isinstance(child, ast.Name)}
        elif isinstance(node, ast.Compare) and all(isinstance(op, ast.Is | ast.IsNot) for op in node.ops):
            handed_on |= {id(node.left)}
    # A dict of arguments counts as handed on where it reaches one of those calls: bound to a name they read
    # (`mask_kwargs = {...}; create_causal_mask(**mask_kwargs)`), not one given to any other function.
    for node in ast.walk(function):
        bound = isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
        if bound and any(isinstance(target, ast.Name) and target.id in passed_names for target in node.targets):
            handed_on |= {id(child) for child in ast.walk(node.value)}
    return tuple(
        ast.unparse(node)
        for node in ast.walk(function)
        if isinstance(node, ast.Name) and node.id == "attention_mask" and isinstance(node.ctx, ast.Load)
        if id(node) not in handed_on
    )


def _callee(call: ast.Call) -> str:
    target = call.func
    while isinstance(target, ast.Subscript):
        target = target.value
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return f"self.{target.attr}" if _is_self(target.value) else target.attr
    return ""


@functools.cache
def forward_reads(cls: type, name: str) -> bool:
    """Whether `cls`'s forward reads `name` (a function it calls, say)."""
    located = method(cls, "forward")
    return located is not None and name in _source_names(located[1])


def builds_masks_with_transformers(cls: type) -> bool:
    """Whether `cls`'s forward builds its masks with transformers' mask builders (`masking_utils`)."""
    located = method(cls, "forward")
    return located is not None and bool(_source_names(located[1]) & MASK_BUILDERS)


@functools.cache
def edits_its_mask(cls: type) -> bool:
    """Whether `cls`'s forward makes its own mask from the one it gets before handing it on (`attention_mask =
    attention_mask & selection`: an indexer's choice merged in, blocks appended). A plan that stands in for the
    decoder's mask would drop what the layer adds."""
    located = method(cls, "forward")
    if located is None:
        return False
    for node in ast.walk(located[1]):
        if isinstance(node, ast.AugAssign):
            targets, value = [node.target], None
        elif isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        else:
            continue
        if not any(isinstance(target, ast.Name) and target.id == "attention_mask" for target in targets):
            continue
        if value is None or any(
            isinstance(name, ast.Name) and name.id == "attention_mask" for name in ast.walk(value)
        ):
            return True
    return False


__all__ = ["MASK_BUILDERS", "builds_masks_with_transformers", "edits_its_mask", "forward_reads", "mask_uses"]
