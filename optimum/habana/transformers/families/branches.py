"""Which class a submodule's call reaches, where a family builds the submodule from a key and branches on it.

Hybrid families build one attribute from a table (`self.mixer = MIXER_TYPES[self.block_type](...)`) and call it in
branches of the same key, the attention's call with the call's keyword arguments and an MLP's without
(`NemotronHBlock`). Qualification asks whether the calls that reach the attention hand the keywords on; this module
reads which branch reaches which class.
"""

import ast
import functools

from .source_facts import _is_self, _module_classes, _resolve, calls_of, method


@functools.cache
def forwards_kwargs_to(cls: type, attribute: str, reaching: frozenset[type] | None = None) -> bool | None:
    """Whether every call of `self.<attribute>` in `cls`'s forward that may reach one of the classes `reaching` (any
    class, when None) passes `**kwargs` on; None when the forward calls it nowhere this reading can see.

    A submodule chosen by a key (`self.mixer = MIXER_TYPES[self.block_type](...)`) and called under a test of that
    key (`if self.block_type == "full_attention": self.mixer(..., **kwargs) else: self.mixer(hidden_states)`) reaches
    in each branch only the classes of the keys that branch admits: the MLP's call is no call of the attention."""
    located = method(cls, "forward")
    if located is None:
        return None
    calls = calls_of(located[1], attribute)
    dispatch = dispatching_key(cls, attribute)
    if dispatch is not None and reaching is not None:
        key, classes_by_key = dispatch
        admitted = branch_keys(located[1], key, frozenset(classes_by_key))
        calls = [
            call
            for call in calls
            if admitted.get(id(call)) is None
            or any(classes_by_key.get(value) in reaching for value in admitted[id(call)])
        ]
    if not calls:
        return None
    return all(any(keyword.arg is None for keyword in call.keywords) for call in calls)


@functools.cache
def dispatching_key(cls: type, attribute: str) -> tuple[str, dict[str, type]] | None:
    """(key, classes by key value) where `cls.__init__` builds `self.<attribute> = MAPPING[self.<key>](...)` from a
    module-level dict of module classes; None otherwise."""
    located = method(cls, "__init__")
    if located is None:
        return None
    owner, function = located
    for node in ast.walk(function):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        built, lookup = node.targets[0], node.value.func
        if not (isinstance(built, ast.Attribute) and built.attr == attribute and _is_self(built.value)):
            continue
        if not (isinstance(lookup, ast.Subscript) and isinstance(lookup.value, ast.Name)):
            continue
        key = lookup.slice
        mapping = _resolve(owner, lookup.value.id)
        if isinstance(key, ast.Attribute) and _is_self(key.value) and isinstance(mapping, dict):
            classes = {value: kind for value, kind in mapping.items() if _module_classes(kind)}
            if classes and all(isinstance(value, str) for value in classes):
                return key.attr, classes
    return None


def branch_keys(function: ast.FunctionDef, key: str, every: frozenset[str]) -> dict[int, frozenset[str] | None]:
    """For each call in `function` (by node id): the values of `self.<key>` (among `every`) under which it runs,
    read off the `if` tests that compare `self.<key>` with string constants (`==`, `!=`, `in`, `not in`); None where
    unconstrained."""
    admitted: dict[int, frozenset[str] | None] = {}

    def values_tested(test: ast.AST) -> tuple[frozenset[str], bool] | None:
        """(the values, whether the test holds for them) of a test of `self.<key>`; None for any other test."""
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
            return None
        left, operation, right = test.left, test.ops[0], test.comparators[0]
        if not (isinstance(left, ast.Attribute) and left.attr == key and _is_self(left.value)):
            return None
        options = right.elts if isinstance(right, ast.Tuple | ast.List | ast.Set) else [right]
        if not all(isinstance(option, ast.Constant) and isinstance(option.value, str) for option in options):
            return None
        values = frozenset(option.value for option in options)
        return values, isinstance(operation, ast.Eq | ast.In)

    def visit(statements: list[ast.stmt], allowed: frozenset[str] | None, universe: frozenset[str]) -> None:
        for statement in statements:
            if isinstance(statement, ast.If) and (tested := values_tested(statement.test)) is not None:
                values, holds = tested
                current = universe if allowed is None else allowed
                inside, outside = (
                    (current & values, current - values) if holds else (current - values, current & values)
                )
                visit(statement.body, inside, universe)
                visit(statement.orelse, outside, universe)
                continue
            nested = [getattr(statement, field, None) for field in ("body", "orelse", "finalbody", "handlers")]
            for child in ast.iter_child_nodes(statement):
                if not isinstance(child, ast.stmt | ast.excepthandler):
                    for node in ast.walk(child):
                        if isinstance(node, ast.Call):
                            admitted[id(node)] = allowed
            for block in nested:
                if isinstance(block, list):
                    visit([item for item in block if isinstance(item, ast.stmt)], allowed, universe)
                    for handler in (item for item in block if isinstance(item, ast.excepthandler)):
                        visit(handler.body, allowed, universe)

    visit(function.body, None, every)
    return admitted


__all__ = ["branch_keys", "dispatching_key", "forwards_kwargs_to"]
