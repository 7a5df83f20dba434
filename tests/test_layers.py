"""The layer rule (docs/layout.md): a module imports only from its own layer or the layers below it, and no two
modules import each other at run time. Every module of the package must be placed in a layer, so a new one is
placed on purpose. Imports anywhere in a module count (inside functions, and under TYPE_CHECKING for the layer
rule, since an annotation is a dependency too)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

ROOT = "verispec"  # the package's __init__: in the api layer, covering nothing else
# Bottom to top. A name covers the module of that name and everything under it (the longest match wins).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("verispec.errors", "verispec.config", "verispec.atomic", "verispec.console", "verispec.stats",
                    "verispec.datasets", "verispec.detokenize", "verispec.sampling", "verispec.tree",
                    "verispec.rejection", "verispec.chisquare", "verispec.trace", "verispec.chat",
                    "verispec.constraints", "verispec.constraint_bounds")),
    ("core", ("verispec.core",)),
    ("models", ("verispec.models", "verispec.ngram.table", "verispec.ngram")),
    ("drafters", ("verispec.drafters", "verispec.tuning")),
    ("engine", ("verispec.engine", "verispec.plan", "verispec.step", "verispec.batch", "verispec.faults",
                "verispec.adapt")),
    ("api", ("verispec.api", "verispec.audit", "verispec.render", "verispec")),
    ("front ends and pipelines", ("verispec.cli", "verispec.__main__", "verispec.serve", "verispec.viz",
                                  "verispec.bench", "verispec.analyze", "verispec.distill", "verispec.head_training",
                                  "verispec.selfspec", "verispec.ngram.build")),
)


def module_names(root: Path = SRC) -> dict[str, Path]:
    names = {}
    for path in (root / "verispec").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> list[tuple[str, bool]]:
    """(imported module, type-only) for each import of a module of `known` in `source`."""
    found: list[tuple[str, bool]] = []
    package = name if is_package else name.rpartition(".")[0]

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for grandchild in child.body:
                    visit_one(grandchild, True)
                for grandchild in child.orelse:
                    visit_one(grandchild, typing_only)
                continue
            visit_one(child, typing_only)

    def visit_one(node: ast.AST, typing_only: bool) -> None:
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append((target, typing_only))
        visit(node, typing_only)

    visit(ast.parse(source), False)
    return found


def layer_of(name: str) -> int | None:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            covers = name == prefix or (name.startswith(prefix + ".") and prefix != ROOT)  # the package's own
            if covers and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def violations(graph: dict[str, list[tuple[str, bool]]]) -> list[str]:
    """Every upward import and every module in no layer, as lines."""
    problems = [f"{name} is in no layer: place it in tests/test_layers.py LAYERS" for name in graph
                if layer_of(name) is None]
    for name, imports in graph.items():
        own = layer_of(name)
        for target, _ in imports:
            theirs = layer_of(target)
            if own is not None and theirs is not None and theirs > own:
                problems.append(f"{name} ({LAYERS[own][0]}) imports {target} ({LAYERS[theirs][0]}), a layer above it")
    return sorted(set(problems))


def cycles(graph: dict[str, list[tuple[str, bool]]]) -> list[list[str]]:
    """Groups of modules that import each other at run time (strongly connected, type-only imports left out)."""
    edges = {name: sorted({t for t, typing_only in imports if not typing_only}) for name, imports in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def package_graph() -> dict[str, list[tuple[str, bool]]]:
    names = module_names()
    known = set(names)
    return {name: imports_of(name, path.read_text(), path.name == "__init__.py", known) for name, path in names.items()}


def test_every_module_imports_only_downward():
    problems = violations(package_graph())
    assert not problems, "\n".join(problems)


def test_no_modules_import_each_other():
    found = cycles(package_graph())
    assert not found, found


def test_the_check_sees_an_upward_import_a_lazy_one_and_a_cycle():
    """The checker itself: an engine import inside a model's function, a typing-only one, and a runtime cycle."""
    known = {"verispec.models.runners.hf", "verispec.engine", "verispec.drafters.a", "verispec.drafters.b"}
    lazy = "def f():\n    from verispec.engine import SpeculativeEngine\n"
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from verispec.engine import SpeculativeEngine\n"
    for source in (lazy, typed):
        graph = {"verispec.models.runners.hf": imports_of("verispec.models.runners.hf", source, False, known)}
        assert violations(graph) == ["verispec.models.runners.hf (models) imports verispec.engine (engine), a layer above it"]
    a = imports_of("verispec.drafters.a", "from verispec.drafters import b\n", False, known)
    b = imports_of("verispec.drafters.b", "import verispec.drafters.a\n", False, known)
    assert cycles({"verispec.drafters.a": a, "verispec.drafters.b": b}) == [["verispec.drafters.a", "verispec.drafters.b"]]
    b_typed = imports_of("verispec.drafters.b", typed.replace("engine import SpeculativeEngine", "drafters import a"),
                         False, known)
    assert b_typed == [("verispec.drafters.a", True)]
    assert cycles({"verispec.drafters.a": a, "verispec.drafters.b": b_typed}) == []
    assert violations({"verispec.newthing": []}) == ["verispec.newthing is in no layer: place it in tests/test_layers.py LAYERS"]
