"""What a family's modeling source says about its attention, read with `ast` (nothing in it is executed).

A family qualifies for the Gaudi attention by what its code does (`qualification.py` states the rules); this module
answers the questions those rules ask of the code: which submodules a class builds, which of them look their
attention function up in transformers' attention interface and with which arguments they call it, whether a
forward hands the call's keyword arguments (the flags, and the batch plan) on to a submodule, and where a forward
reads the attention mask.
"""

import ast
import functools
import inspect
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

from torch import nn
from transformers import GenerationMixin


# Calls that compute attention scores when a class does it itself instead of through the interface.
ATTENTION_KERNEL_CALLS = frozenset({"scaled_dot_product_attention", "flash_attn_func", "flash_attn_varlen_func"})
SCORE_PRODUCTS = frozenset({"matmul", "bmm", "baddbmm", "einsum"})
TOKEN_MASKS = frozenset({"attention_mask", "causal_mask", "attn_mask", "is_causal", "mask"})


# transformers' mask builders (`masking_utils`): a mask made by them follows the attention's registered mask function.
@dataclass(frozen=True)
class InterfaceCall:
    """One call of the function a class looked up in transformers' attention interface."""

    keywords: frozenset[str]
    passes_kwargs: bool  # `**kwargs`: the flags and the batch plan travel there
    positional: int  # module, query, key, value, mask: 5


# A family's judgement reads a few modeling files, class after class. Parsing a whole file costs ~40 ms (judging every
# family parsed 180 of them: 7 of its 15 s), so a class's own lines are parsed where they can be found with certainty,
# and the whole file where not. The last few files' lines are kept, and the facts drawn from the syntax trees are
# cached by the functions below. Keeping every tree read would hold about a million objects once every family is
# judged (the family table), which every full garbage collection of the process then walks (transformers'
# continuous-batching engine runs two at each stop): 0.43 s each, 0.14 s with these bounds.
SYNTAX_KEPT_FILES = 4
SYNTAX_KEPT_CLASSES = 64


@functools.lru_cache(maxsize=SYNTAX_KEPT_FILES)
def _lines(path: str) -> tuple[str, ...]:
    return tuple(Path(path).read_text(encoding="utf-8").splitlines(keepends=True))


@functools.lru_cache(maxsize=SYNTAX_KEPT_FILES)
def _tree(path: str) -> ast.Module:
    return ast.parse("".join(_lines(path)))


def _class_lines(cls: type, path: str) -> tuple[int, int] | None:
    """The lines [start, end) of `cls`'s top-level `class` statement, or None where they cannot be told for sure.

    The statement (with its decorators) ends before the next line that starts in the first column (a comment or a
    closing bracket aside). A line like that inside a string or a bracket leaves a fragment that does not parse; a
    `class` line inside a string is caught by the class's own functions, whose first lines must all lie within.
    """
    lines = _lines(path)
    header = (f"class {cls.__name__}(", f"class {cls.__name__}:")
    start = next((index for index, line in enumerate(lines) if line.startswith(header)), None)
    if start is None:
        return None
    end = start + 1
    while start > 0 and lines[start - 1].startswith("@"):  # its decorators, one line each
        start -= 1
    if start > 0 and lines[start - 1][:1] in (" ", "\t", ")", "]", "}"):  # a decorator over several lines
        return None
    while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t#)]}"):
        end += 1
    for value in vars(cls).values():
        code = getattr(value, "__code__", None)
        if code is not None and code.co_filename == path and not start < code.co_firstlineno <= end:
            return None
    return start, end


@functools.lru_cache(maxsize=SYNTAX_KEPT_CLASSES)
def class_node(cls: type) -> ast.ClassDef | None:
    """The `class` statement of `cls` in its source file (top level), or None for classes without Python source."""
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return None
    if path is None:
        return None
    span = _class_lines(cls, path)
    if span is not None:
        try:
            (node,) = ast.parse("".join(_lines(path)[span[0] : span[1]])).body
        except (SyntaxError, ValueError):
            node = None
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return ast.increment_lineno(node, span[0])
    for node in _tree(path).body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    return None


@functools.lru_cache(maxsize=SYNTAX_KEPT_CLASSES)
def method(cls: type, name: str) -> tuple[type, ast.FunctionDef] | None:
    """The first definition of `name` along `cls`'s MRO in a transformers (or user) class: (owner, node)."""
    for owner in cls.__mro__:
        if name not in vars(owner):
            continue
        if owner.__module__.startswith("torch.") or owner is object:
            return None
        node = class_node(owner)
        if node is None:
            return None
        for statement in node.body:
            if isinstance(statement, ast.FunctionDef) and statement.name == name:
                return owner, statement
        return None
    return None


def _source_names(node: ast.AST) -> frozenset[str]:
    """The names and attribute names read or written anywhere in `node` (kept while its tree is)."""
    names = _NAMES.get(node)
    if names is None:
        names = _NAMES[node] = frozenset(
            child.id if isinstance(child, ast.Name) else child.attr
            for child in ast.walk(node)
            if isinstance(child, ast.Name | ast.Attribute)
        )
    return names


_NAMES: weakref.WeakKeyDictionary[ast.AST, frozenset[str]] = weakref.WeakKeyDictionary()  # nodes hash by identity


def _resolve(owner: type, name: str) -> object:
    return vars(sys.modules[owner.__module__]).get(name)


def _module_classes(value: object) -> set[type]:
    """`value` if it is a module class, or the module classes a dict or tuple of them holds."""
    if isinstance(value, type) and issubclass(value, nn.Module):
        return {value}
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return {item for item in value if isinstance(item, type) and issubclass(item, nn.Module)}
    return set()


@functools.cache
def submodules(cls: type) -> dict[str, set[type]]:
    """The attributes `cls.__init__` assigns to submodules it builds, with the classes each may hold.

    Read from every `__init__` along the MRO, so a subclass that keeps its parent's layers is read through the
    parent; a class reached through local names (`layer_class = TYPES[kind]; layers.append(layer_class(...))`) counts.
    """
    found: dict[str, set[type]] = {}
    for owner in cls.__mro__:
        if owner.__module__.startswith("torch.") or owner is object or "__init__" not in vars(owner):
            continue
        located = method(owner, "__init__")
        if located is None:
            continue
        function = located[1]
        sources = _local_sources(function)
        optional = {id(node) for gate in _cross_attention_gates(function) for node in ast.walk(gate)}
        for node in ast.walk(function):
            if id(node) in optional:
                continue
            targets = [(target, node.value) for target in node.targets] if isinstance(node, ast.Assign) else []
            if _appends_to_attribute(node):  # self.layers.append(Layer(...)) into an nn.ModuleList
                targets = [(node.func.value, argument) for argument in node.args]
            for target, value in targets:
                if not (isinstance(target, ast.Attribute) and _is_self(target.value)):
                    continue
                classes = set()
                for name in _closure(_source_names(value), sources) | _names_built_by_own_methods(cls, value):
                    classes |= _module_classes(_resolve(owner, name))
                if classes:
                    found.setdefault(target.attr, set()).update(classes)
    return found


def _names_built_by_own_methods(cls: type, value: ast.AST) -> set[str]:
    """`self.layers = self.get_layers()` (Zamba 2): the names the called method reads where it builds what it returns."""
    names: set[str] = set()
    for node in ast.walk(value):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_self(node.func.value):
            located = method(cls, node.func.attr)
            if located is not None and located[1].name != "__init__":
                names |= _closure(set(_source_names(located[1])), _local_sources(located[1]))
    return names


def _appends_to_attribute(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("append", "extend", "insert")
        and isinstance(node.func.value, ast.Attribute)
        and _is_self(node.func.value.value)
    )


def _cross_attention_gates(function: ast.FunctionDef) -> list[ast.If]:
    """`if config.add_cross_attention:` blocks: cross-attention a decoder-only config does not build."""
    return [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.If) and "add_cross_attention" in _source_names(node.test)
    ]


def _local_sources(function: ast.FunctionDef) -> dict[str, set[str]]:
    """For each local name: the names read where the function binds it, or appends to it."""
    sources: dict[str, set[str]] = {}

    def bind(target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Name):
            sources.setdefault(target.id, set()).update(_source_names(value))
        elif isinstance(target, ast.Tuple | ast.List | ast.Starred):
            for element in ast.iter_child_nodes(target):
                bind(element, value)

    arguments = function.args
    for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
        if argument.annotation is not None:  # a module handed to the constructor: `shared_transformer: Zamba2...`
            sources.setdefault(argument.arg, set()).update(_source_names(argument.annotation))
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                bind(target, node.value)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and node.value is not None:
            bind(node.target, node.value)
        elif isinstance(node, ast.For | ast.comprehension):
            bind(node.target, node.iter)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "extend", "insert")
            and isinstance(node.func.value, ast.Name)
        ):
            for argument in node.args:
                bind(node.func.value, argument)
    return sources


def _closure(names: set[str], sources: dict[str, set[str]]) -> set[str]:
    seen, pending = set(), list(names)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        pending += sources.get(name, ())
    return seen


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def interface_lookup_names(function: ast.FunctionDef) -> set[str]:
    """The local names a function binds to a lookup in `ALL_ATTENTION_FUNCTIONS` (`get_interface(...)` or `[...]`)."""
    names = set()
    for node in ast.walk(function):
        lookup = isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None
        if lookup and "ALL_ATTENTION_FUNCTIONS" in _source_names(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names


@functools.cache
def interface_calls(cls: type) -> list[InterfaceCall]:
    """Every call of an attention-interface function in `cls`'s forward."""
    located = method(cls, "forward")
    if located is None:
        return []
    function = located[1]
    names = interface_lookup_names(function)
    calls = []
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            keywords = frozenset(keyword.arg for keyword in node.keywords if keyword.arg is not None)
            passes_kwargs = any(keyword.arg is None for keyword in node.keywords)
            calls.append(InterfaceCall(keywords, passes_kwargs, len(node.args)))
    return calls


@functools.cache
def computes_attention_itself(cls: type) -> bool:
    """Whether a method of `cls` computes masked attention over tokens without the interface: a call of an attention
    kernel, or a softmax over a product of tensors, where a mask or causality is read too (a router's softmax or an
    attention over layers, which read neither, are not token attention)."""
    node = class_node(cls)
    if node is None:
        return False
    names = {name.lower() for name in _source_names(node)}
    products = bool(names & SCORE_PRODUCTS) or any(
        isinstance(child, ast.BinOp) and isinstance(child.op, ast.MatMult) for child in ast.walk(node)
    )
    scores = bool(names & ATTENTION_KERNEL_CALLS) or ("softmax" in names and products)
    return scores and bool(names & TOKEN_MASKS)


@functools.cache
def drops_generation_kwargs(cls: type) -> str | None:
    """Where the `prepare_inputs_for_generation` that `cls` runs hands each step only the inputs it names (it neither
    uses its `**` parameter nor calls the method it overrides, so what generate() adds to the model's keyword
    arguments, the attention flags, never reaches forward): that, said in words naming the class. None otherwise.
    An override that calls `super()` leaves it to the next definition along the MRO (the Gaudi mixin's does)."""
    for owner in cls.__mro__:
        if "prepare_inputs_for_generation" not in vars(owner):
            continue
        if owner is GenerationMixin:  # transformers' own hands every keyword on: its file is not read
            return None
        body = getattr(class_node(owner), "body", ())
        function = next(
            (item for item in body if getattr(item, "name", None) == "prepare_inputs_for_generation"), None
        )
        if not isinstance(function, ast.FunctionDef) or function.args.kwarg is None:
            return None  # no source to read; or a keyword it does not name raises TypeError there, in no silence
        rest = function.args.kwarg.arg
        names = {node.id for node in ast.walk(function) if isinstance(node, ast.Name)}
        if "super" in names:
            continue
        if rest in names:
            return None
        return (
            f"{owner.__name__}.prepare_inputs_for_generation hands each step only the inputs it names (its **{rest} go "
            "nowhere)"
        )
    return None


@functools.cache
def forward_parameters(cls: type) -> set[str]:
    located = method(cls, "forward")
    if located is None:
        return set()
    arguments = located[1].args
    return {argument.arg for argument in arguments.args + arguments.kwonlyargs}


def calls_of(function: ast.FunctionDef, attribute: str) -> list[ast.Call]:
    """The calls in `function` of the submodule `self.<attribute>`: directly, indexed, or through a loop variable or
    a local name bound from an expression that reads it (`for layer in self.layers[:n]: layer(...)`)."""
    bound: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.For | ast.comprehension) and _reads_attribute(node.iter, attribute):
            bound |= {name.id for name in ast.walk(node.target) if isinstance(name, ast.Name)}
        elif isinstance(node, ast.Assign) and _binds_module(node.value, attribute):
            bound |= {name.id for target in node.targets for name in ast.walk(target) if isinstance(name, ast.Name)}
    calls = []
    for node in ast.walk(function):
        if not isinstance(node, ast.Call):
            continue
        target = node.func
        while isinstance(target, ast.Subscript | ast.Attribute) and not (
            isinstance(target, ast.Attribute) and _is_self(target.value)
        ):
            target = target.value  # self.layers[i](...), self.model.decoder(...)
        if (
            isinstance(target, ast.Attribute)
            and target.attr == attribute
            and _is_self(target.value)
            or isinstance(target, ast.Name)
            and target.id in bound
        ):
            calls.append(node)
    return calls


def _binds_module(value: ast.AST, attribute: str) -> bool:
    """Whether `name = value` binds the submodule `self.<attribute>` itself (`layer = self.layers[i]`), not the
    result of calling it (`output, _ = self.self_attn(...)`, whose later method calls are no calls of the module)."""
    return not isinstance(value, ast.Call) and _reads_attribute(value, attribute)


def _reads_attribute(node: ast.AST, attribute: str) -> bool:
    return any(
        isinstance(child, ast.Attribute) and child.attr == attribute and _is_self(child.value)
        for child in ast.walk(node)
    )


@functools.cache
def call_keywords(cls: type, attribute: str) -> set[str]:
    """The keyword names `cls`'s forward passes in its calls of `self.<attribute>`."""
    located = method(cls, "forward")
    if located is None:
        return set()
    return {keyword.arg for call in calls_of(located[1], attribute) for keyword in call.keywords if keyword.arg}


@functools.cache
def decoder_path(cls: type) -> tuple[str, ...]:
    """The attribute path from the causal LM to the decoder its forward calls: the submodule it hands the attention
    mask to (where the masks are built), `("model",)` for most families, `("model", "decoder")` where it calls
    `self.model.decoder(...)` (OPT), past the base model's own forward. Read off that call, not off the base model's
    prefix, which can name another model's attribute (Llama 4's causal LM: "language_model", the multimodal model's
    name for it, while its decoder is `self.model`). Where no call takes the mask, the call that starts at the
    prefix; empty where there is none either (the base model is then the decoder)."""
    located = method(cls, "forward")
    if located is None:
        return ()
    at_prefix = ()
    for node in ast.walk(located[1]):
        if not isinstance(node, ast.Call):
            continue
        path, target = [], node.func
        while isinstance(target, ast.Attribute):
            path.insert(0, target.attr)
            target = target.value
        if not (_is_self(target) and path):
            continue
        if any(keyword.arg == "attention_mask" for keyword in node.keywords):
            return tuple(path)
        if path[0] == cls.base_model_prefix and not at_prefix:
            at_prefix = tuple(path)
    return at_prefix


@functools.cache
def interface_lookup_names_of(cls: type) -> frozenset[str]:
    located = method(cls, "forward")
    return frozenset() if located is None else frozenset(interface_lookup_names(located[1]))


@functools.cache
def reads_config(cls: type, name: str) -> bool:
    """Whether `cls.__init__` reads `config.<name>`."""
    located = method(cls, "__init__")
    return located is not None and any(
        isinstance(node, ast.Attribute) and node.attr == name and getattr(node.value, "id", None) == "config"
        for node in ast.walk(located[1])
    )


@functools.cache
def init_names(cls: type) -> set[str]:
    """The names and attributes `cls.__init__` reads or writes (e.g. `v_head_dim`)."""
    located = method(cls, "__init__")
    return set() if located is None else _source_names(located[1])


__all__ = [
    "InterfaceCall",
    "call_keywords",
    "calls_of",
    "class_node",
    "computes_attention_itself",
    "forward_parameters",
    "decoder_path",
    "drops_generation_kwargs",
    "init_names",
    "interface_calls",
    "interface_lookup_names_of",
    "method",
    "reads_config",
    "submodules",
]
