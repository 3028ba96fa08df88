"""What a family's attention does with its KV cache, read from its code: the facts that decide whether
transformers' continuous-batching engine, whose attention function writes and reads the paged cache itself, can serve
it (`continuous_batching.check_engine_serves`)."""

import ast
import functools

from .source_facts import _is_self, _source_names, interface_lookup_names, method


@functools.cache
def writes_cache_at_own_index(cls: type) -> bool:
    """Whether every cache write in `cls`'s forward (`past_key_values.update(keys, values, index)`) is at
    `self.layer_idx`: a recurrent family writes each cycle's keys at an offset from it (HRM's
    `self.layer_idx + cycle_offset`), which an engine that reads its cache by the module's index would miss."""
    located = method(cls, "forward")
    if located is None:
        return True
    for node in ast.walk(located[1]):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"):
            continue
        if "past_key_values" not in _source_names(node.func.value) or len(node.args) < 3:
            continue
        index = node.args[2]
        if not (isinstance(index, ast.Attribute) and index.attr == "layer_idx" and _is_self(index.value)):
            return False
    return True


@functools.cache
def computes_with_cached_states(cls: type) -> tuple[str, ...]:
    """The keys or values `cls`'s forward reads after its cache update other than in the attention-interface call
    (`key_states.repeat(...)`, a mask computed from `value_states`): in continuous batching the attention function
    writes and reads the engine's cache itself, and such code sees other tensors than the engine holds."""
    located = method(cls, "forward")
    if located is None:
        return ()
    function = located[1]
    updates = [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and node.value.func.attr == "update"
        and "past_key_values" in _source_names(node.value.func.value)
    ]
    if not updates:
        return ()
    update = updates[0]
    cached = {name.id for target in update.targets for name in ast.walk(target) if isinstance(name, ast.Name)}
    lookups = interface_lookup_names(function)
    handed_on = {
        id(child)
        for node in ast.walk(function)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in lookups
        for argument in list(node.args) + [keyword.value for keyword in node.keywords]
        for child in ast.walk(argument)
    }
    for node in ast.walk(function):
        # Not computing with the values: their shape, dtype or device; or stored as they are for a later layer
        # (`shared_kv_states[...] = key_states, value_states`), which reads them through the same cache.
        if isinstance(node, ast.Attribute) and node.attr in ("shape", "size", "dtype", "device"):
            handed_on.add(id(node.value))
        elif isinstance(node, ast.Assign) and all(isinstance(target, ast.Subscript) for target in node.targets):
            handed_on |= {id(child) for child in ast.walk(node.value) if isinstance(child, ast.Name)}
    return tuple(
        sorted(
            {
                node.id
                for node in ast.walk(function)
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in cached
                if node.lineno > update.end_lineno and id(node) not in handed_on
            }
        )
    )


__all__ = ["computes_with_cached_states", "writes_cache_at_own_index"]
