"""flashpar's imports point down: the graph of which module imports which (read from the source, every import in a
file, those inside functions too, none under ``if TYPE_CHECKING:``, which never runs) has no cycle.

``from a.b import c`` is an arrow to the module ``a.b.c`` where that is a module, else to ``a.b``; ``import a.b`` is an
arrow to ``a.b``; the package ``__init__`` a module sits in is not counted (every module of a package imports it)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def modules(src: Path, top: str) -> dict[str, Path]:
    """Dotted name -> file of every module of the package ``top`` under ``src``."""
    out = {}
    for f in sorted((src / top).rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _runtime_imports(tree: ast.AST):
    """The import statements of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(src: Path, top: str) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: the line of the first such import}, within the package ``top``."""
    mods = modules(src, top)
    graph: dict[str, dict[str, int]] = {}
    for name, f in mods.items():
        arrows: dict[str, int] = {}
        for node in _runtime_imports(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1
                    pkg = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                while target and target not in mods:  # (an attribute of a module: the module)
                    target = target.rpartition(".")[0]
                if target and target != name:
                    arrows.setdefault(target, node.lineno)
        graph[name] = arrows
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each holds a cycle), by an iterative Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _describe(graph, comp: list[str]) -> str:
    inside = set(comp)
    return "; ".join(f"{v} -> {w} (line {line})" for v in comp for w, line in graph[v].items() if w in inside)


def test_flashpar_has_no_import_cycle():
    graph = import_graph(SRC, "flashpar")
    assert len(graph) > 100  # (the package was found and read)
    loops = cycles(graph)
    assert not loops, "import cycles: " + " | ".join(_describe(graph, c) for c in loops)


def test_the_walk_finds_a_cycle_through_a_function_level_import_and_skips_type_checking(tmp_path):
    """A package whose ``a`` imports ``b`` at the top, ``b`` imports ``c`` inside a function and ``c`` imports ``a``
    relatively: one cycle of three; an import under ``if TYPE_CHECKING:`` and one of the package itself make none."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("def thing():\n    import pkg.c\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n")
    (pkg / "e.py").write_text("import pkg.d\nimport pkg\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b": 1} and graph["pkg.c"] == {"pkg.a": 1} and graph["pkg.d"] == {}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
