"""flashpar's imports point down: the graph of which module imports which, read from the source (every import in a
file: those inside functions and those under ``if TYPE_CHECKING:`` too, which a type checker follows), has no cycle,
and its arrows between flashpar's top-level packages and modules (its *parts*) follow ``LAYERS``.

``from a.b import c`` is an arrow to the module ``a.b.c`` where that is a module, else to ``a.b``; ``import a.b`` is an
arrow to ``a.b``; the package ``__init__`` a module sits in is not counted (every module of a package imports it).

The layers, from the ground up (docs/design.md draws them)::

    gpu_check                                        make gpu-check: runs the CLI
    cli | generate_command                           the command line: names each command's module | flashpar
                                                     generate (reads the trainer's checkpoints and tokenizers)
    bench                                            the benchmarks: run the trainer, inference and torch side by side
    train | infer                                    the trainer | prefill and decode (neither imports the other)
    sim                                              the simulator (the trainer's ZeRO-3 choice simulates its step)
    models                                           the model math: the Llama, rope, the mesh model, its layout
    cp                                               FlashCP: plans, the K/V exchange, attention
    overlap                                          FlashOverlap: tensors and groups only
    links | dims                                     a running job's figures | the mesh's sizes and rules
    cost | options                                   the hardware model | how a model runs on its mesh
    dist                                             resolving groups, point-to-point, timeouts, input checks
    flashpar | mesh | rows | corpus | ...            the ground: import nothing of flashpar (mesh: every group made)

A part may import its own modules and those of the parts below its layer; not those of its own layer, nor above.
``KNOWN`` would list an arrow against the layers with its reason; it is empty and stays so.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

LAYERS = (
    ("flashpar", "mesh", "rows", "corpus", "peak_memory", "lifeline", "ranks", "data", "timeout", "tokenizer_files"),
    ("dist",),
    ("cost", "options"),
    ("links", "dims"),
    ("overlap",),
    ("cp",),
    ("models",),
    ("sim",),
    ("train", "infer"),
    ("bench",),
    ("cli", "generate_command"),
    ("gpu_check",),
)
"""flashpar's parts (``part``), layer by layer from the ground up."""

KNOWN: dict[tuple[str, str], str] = {}
"""Arrows against ``LAYERS`` that remain, each with its reason (none: the test keeps it so)."""


def modules(src: Path, top: str) -> dict[str, Path]:
    """Dotted name -> file of every module of the package ``top`` under ``src``."""
    out = {}
    for f in sorted((src / top).rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def import_graph(src: Path, top: str) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: the line of the first such import}, within the package ``top``."""
    mods = modules(src, top)
    graph: dict[str, dict[str, int]] = {}
    for name, f in mods.items():
        arrows: dict[str, int] = {}
        nodes = [n for n in ast.walk(ast.parse(f.read_text(), str(f))) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in sorted(nodes, key=lambda n: n.lineno):
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


def part(module: str) -> str:
    """The top-level package or module ``module`` belongs to (``flashpar`` itself: the package's ``__init__``)."""
    names = module.split(".")
    return names[1] if len(names) > 1 else names[0]


def against_layers(graph: dict[str, dict[str, int]], layers) -> list[tuple[str, str, int]]:
    """``(module, module it imports, line)`` of every arrow between two parts whose target is not in a lower layer
    than its source (the same layer or above)."""
    level = {p: i for i, layer in enumerate(layers) for p in layer}
    return [(v, w, line) for v, arrows in graph.items() for w, line in arrows.items()
            if part(v) != part(w) and level[part(w)] >= level[part(v)]]


def _describe(graph, comp: list[str]) -> str:
    inside = set(comp)
    return "; ".join(f"{v} -> {w} (line {line})" for v in comp for w, line in graph[v].items() if w in inside)


def test_flashpar_has_no_import_cycle():
    graph = import_graph(SRC, "flashpar")
    assert len(graph) > 100  # (the package was found and read)
    loops = cycles(graph)
    assert not loops, "import cycles: " + " | ".join(_describe(graph, c) for c in loops)


def test_every_part_of_flashpar_has_its_layer():
    parts = {part(m) for m in import_graph(SRC, "flashpar")}
    placed = [p for layer in LAYERS for p in layer]
    assert len(placed) == len(set(placed)), placed
    assert parts == set(placed), f"parts without a layer: {sorted(parts - set(placed))}; " \
                                 f"layers without a part: {sorted(set(placed) - parts)}"


def test_flashpar_imports_point_down_the_layers():
    graph = import_graph(SRC, "flashpar")
    up = against_layers(graph, LAYERS)
    new = [f"{v} -> {w} (line {line})" for v, w, line in up if (v, w) not in KNOWN]
    assert not new, "imports that do not point down the layers (tests/test_import_graph.py LAYERS): " + "; ".join(new)
    gone = sorted(set(KNOWN) - {(v, w) for v, w, _ in up})
    assert not gone, f"KNOWN arrows that no longer exist (strike them): {gone}"


def test_the_walk_finds_a_cycle_through_function_level_and_type_checking_imports(tmp_path):
    """A package whose ``a`` imports ``b`` at the top, ``b`` imports ``c`` inside a function and ``c`` imports ``a``
    relatively: one cycle of three; ``d`` and ``e`` import each other, ``d`` under ``if TYPE_CHECKING:``: another; an
    import of the package itself makes none."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("def thing():\n    import pkg.c\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n")
    (pkg / "e.py").write_text("import pkg.d\nimport pkg\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b": 1} and graph["pkg.c"] == {"pkg.a": 1} and graph["pkg.d"] == {"pkg.e": 3}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.d", "pkg.e"]]


def test_an_import_of_the_same_layer_or_above_is_against_the_layers(tmp_path):
    """Parts ``low`` < ``mid`` | ``side`` < ``top``: an import down is fine; sideways (``mid`` -> ``side``) and up
    (``low`` -> ``top``, inside a function) are against the layers; a part's own modules are not."""
    pkg = tmp_path / "pkg"
    (pkg / "mid").mkdir(parents=True)
    for name, text in {"__init__.py": "", "low.py": "def f():\n    from pkg import top\n", "side.py": "",
                       "top.py": "from pkg.mid import inner\nfrom pkg import low\n", "mid/__init__.py": "",
                       "mid/inner.py": "from pkg.mid import other\nfrom pkg import side, low\n",
                       "mid/other.py": ""}.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    layers = (("pkg", "low"), ("mid", "side"), ("top",))
    assert sorted(against_layers(graph, layers)) == [("pkg.low", "pkg.top", 2), ("pkg.mid.inner", "pkg.side", 2)]
