"""The house rules of the package, checked on its source: small modules, small folders, a docstring on every module,
and imports that point one way (example scripts' code -> library core), with no circle anywhere.

Imports are read from the source (every `import` statement, those inside functions and `TYPE_CHECKING` blocks
included), so a circle that only a lazy import hides still counts.
"""

import ast
from collections import defaultdict
from pathlib import Path

from tests.helpers import ROOT


PACKAGE = ROOT / "optimum" / "habana"
MAX_MODULE_LINES = 500
MAX_MODULES_PER_FOLDER = 12
SCRIPTS_PACKAGE = "optimum.habana.cli"
# `python -m optimum.habana.serve` and `python -m optimum.habana.families`: public entry points, thin modules that
# start their command in `cli`.
ENTRY_POINTS = {"optimum.habana.serve", "optimum.habana.families"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str) -> set[str]:
    """The package's modules that `name` imports, wherever the import statement stands."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    return {target for target in targets if target in MODULES and target != name}


IMPORTS = {name: imported_modules(name) for name in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_is_over_the_line_limit():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these modules by what their parts do: {long}"


def test_no_folder_holds_more_than_a_dozen_modules():
    per_folder = defaultdict(list)
    for path in MODULES.values():
        if path.name != "__init__.py":
            per_folder[path.parent.relative_to(ROOT)].append(path.name)
    crowded = {str(folder): len(names) for folder, names in per_folder.items() if len(names) > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"give these folders' jobs subpackages of their own: {crowded}"


def test_every_module_says_what_it_owns():
    undocumented = [name for name, path in MODULES.items() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert not undocumented


def test_no_import_circle_between_modules():
    assert cycles(IMPORTS) == []


def test_no_import_circle_between_the_scripts_subpackages():
    def job(name: str) -> str:
        if name in ENTRY_POINTS:
            return name
        return ".".join(name.split(".")[:4]) if name.startswith(SCRIPTS_PACKAGE + ".") else "core"

    graph = defaultdict(set)
    for name, targets in IMPORTS.items():
        graph[job(name)].update(job(target) for target in targets if job(target) != job(name))
    assert cycles(graph) == []


def test_the_library_core_never_imports_the_scripts_code():
    upward = {
        name: sorted(target for target in targets if target.startswith(SCRIPTS_PACKAGE))
        for name, targets in IMPORTS.items()
        if not name.startswith(SCRIPTS_PACKAGE) and name not in ENTRY_POINTS
    }
    assert {name: targets for name, targets in upward.items() if targets} == {}


def test_the_rules_catch_what_they_are_for():
    """The checks themselves: a circle is found, and so is a lazy import of the scripts' code from the core."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert "optimum.habana.cli.generation.arguments" in IMPORTS["optimum.habana.cli.generation.explain"]
    assert "optimum.habana.cli.serving.command" in IMPORTS["optimum.habana.serve"]
