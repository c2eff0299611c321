"""The house rules of docs/architecture.md, read from the import graph of ``src/popmesh``.

Every ``import`` and ``from ... import`` counts, at module level or inside a function or a
``TYPE_CHECKING`` block. The graph is built from the source text (nothing is imported), so a rule
broken anywhere in the tree fails here, not only on the paths a test happens to run.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = "popmesh"

LAYERS: tuple[tuple[str, ...], ...] = (  # lowest first; the rows of the diagram in docs/architecture.md
    ("core",),
    ("wire",),
    ("engines",),
    ("comm",),
    ("topology", "observe"),
    ("torch", "jax"),
    ("buffers", "population"),
    ("launch",),
    ("compat",),
    ("demo",),
)
LEVEL = {package: level for level, row in enumerate(LAYERS) for package in row}
SUBLAYERS: dict[str, tuple[str, ...]] = {  # a layer split into sub-packages, lowest first; the face on top
    "population": ("decisions", "state", "mechanisms"),  # pure decisions, agent state, weight movers
}
ROOT_IMPORTERS = ("demo",)  # the public face `popmesh` (its __init__) is for users: only the demo is one
ENGINE_MODULES = ("torch.distributed", "mpi4py")  # only engines/ may import these
MAX_TOP_LEVEL = 14  # entries of src/popmesh besides __init__.py, __main__.py and py.typed

# Seed-document names that are also the engines' own primitives; popmesh may use them with its own
# meaning. Every other public name of the five seed APIs belongs to compat/ alone.
ENGINE_VOCABULARY = frozenset({
    "all_gather", "all_reduce", "barrier", "broadcast", "send", "recv", "isend", "irecv", "Group",
    "psum", "pmean", "pmin", "pmax", "fork", "init", "shutdown", "logger",
})


@dataclass(frozen=True)
class Edge:
    """``importer`` imports ``target`` (a module), taking ``names`` from it, at ``line``."""

    importer: str
    target: str
    names: tuple[str, ...]
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / ROOT).rglob("*.py"))}


def is_package(module: str) -> bool:
    return modules()[module].name == "__init__.py"


def resolve(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package(importer) else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def edges() -> tuple[Edge, ...]:
    """Every popmesh-internal import in the tree, each ``from pkg import submodule`` as an edge to it."""
    found: list[Edge] = []
    known = modules()
    for importer, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [Edge(importer, a.name, (), node.lineno) for a in node.names
                          if a.name.split(".")[0] == ROOT]
            elif isinstance(node, ast.ImportFrom):
                target = resolve(importer, node)
                if target.split(".")[0] != ROOT:
                    continue
                plain = []
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in known:
                        found.append(Edge(importer, sub, (), node.lineno))
                    else:
                        plain.append(alias.name)
                if plain:
                    found.append(Edge(importer, target, tuple(plain), node.lineno))
    return tuple(found)


@cache
def external_imports() -> tuple[tuple[str, str, int], ...]:
    """(importer, imported module, line) for every import of a module outside popmesh."""
    found = []
    for importer, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(importer, a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found += [(importer, f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return tuple((i, m, n) for i, m, n in found if m.split(".")[0] != ROOT)


def package_of(module: str) -> str | None:
    """The layer package a module lives in (``comm`` for popmesh.comm.world); None for the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] not in ("__main__",) else None


def where(edge: Edge) -> str:
    return f"{edge.importer}:{edge.line} imports {edge.target}" + (f" ({', '.join(edge.names)})" if edge.names else "")


# --- the rules ------------------------------------------------------------------------------------


def test_every_package_has_a_layer():
    packages = {p.name for p in (SRC / ROOT).iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert packages == set(LEVEL), (
        f"packages without a layer: {sorted(packages - set(LEVEL))}; layers without a package: "
        f"{sorted(set(LEVEL) - packages)} (add them to LAYERS and docs/architecture.md)"
    )


def test_at_most_fourteen_top_level_entries():
    entries = sorted(p.name for p in (SRC / ROOT).iterdir()
                     if p.name not in ("__init__.py", "__main__.py", "py.typed", "__pycache__"))
    assert len(entries) <= MAX_TOP_LEVEL, f"{len(entries)} entries at the top of src/popmesh: {entries}"


def layer_breaches(found: tuple[Edge, ...]) -> list[str]:
    """Imports that run upward or sideways across LAYERS, or reach the public face from inside."""
    breaches = []
    for edge in found:
        src, dst = package_of(edge.importer), package_of(edge.target)
        if src is None:  # the root package and __main__ face the user; they may import any layer
            continue
        if dst is None:
            if src not in ROOT_IMPORTERS:
                breaches.append(f"{where(edge)}: only {ROOT_IMPORTERS} may import the public face `popmesh`")
            continue
        if src == dst:
            continue
        if LEVEL[dst] > LEVEL[src]:
            breaches.append(f"{where(edge)}: upward ({src} is below {dst})")
        elif LEVEL[dst] == LEVEL[src]:
            breaches.append(f"{where(edge)}: sideways ({src} and {dst} share a layer)")
    return breaches


def test_imports_run_downward_only():
    breaches = layer_breaches(edges())
    assert not breaches, "\n".join(breaches)


def sublayer_of(module: str) -> str | None:
    """The sub-package of a split layer a module lives in (``decisions`` for
    popmesh.population.decisions.selection); None for the layer's own ``__init__`` (its face)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] in SUBLAYERS else None


def sublayer_breaches(found: tuple[Edge, ...]) -> list[str]:
    """Imports inside a split layer that run upward across its SUBLAYERS, or reach the layer's face
    (its ``__init__``, which imports every sub-package) from inside a sub-package."""
    breaches = []
    for edge in found:
        layer = package_of(edge.importer)
        if layer not in SUBLAYERS or package_of(edge.target) != layer:
            continue
        src, dst = sublayer_of(edge.importer), sublayer_of(edge.target)
        if src is None or src == dst:
            continue
        order = SUBLAYERS[layer]
        if dst is None:
            breaches.append(f"{where(edge)}: the face of {layer}/ from inside its {src}/ (import the module itself)")
        elif order.index(dst) > order.index(src):
            breaches.append(f"{where(edge)}: upward inside {layer}/ ({src} is below {dst})")
    return breaches


def test_split_layers_show_their_sub_layers():
    for layer, order in SUBLAYERS.items():
        entries = {p.name for p in (SRC / ROOT / layer).iterdir() if p.name != "__pycache__"}
        assert entries == {"__init__.py", *order}, (
            f"{layer}/ holds {sorted(entries - {'__init__.py', *order})} beside its sub-packages {list(order)}: "
            f"move each module into the sub-package of its kind (or add a sub-layer to SUBLAYERS and "
            f"docs/architecture.md)")


def test_sub_layers_import_downward_only():
    breaches = sublayer_breaches(edges())
    assert not breaches, "\n".join(breaches)


def test_no_import_cycle():
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for edge in edges():
        if edge.target in graph and edge.target != edge.importer:
            graph[edge.importer].add(edge.target)
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles)


def home_package(module: str) -> str:
    return module if module in modules() and is_package(module) else module.rsplit(".", 1)[0]


def private_breaches(found: tuple[Edge, ...]) -> list[str]:
    """Imports of a ``_private`` name or module from a package other than the importer's own."""
    breaches = []
    for edge in found:
        private = [n for n in edge.names if n.startswith("_") and not n.startswith("__")]
        private_module = [p for p in edge.target.split(".") if p.startswith("_") and not p.startswith("__")]
        if (private or private_module) and home_package(edge.importer) != home_package(edge.target):
            breaches.append(where(edge))
    return breaches


def test_no_private_name_crosses_a_package():
    breaches = private_breaches(edges()) + private_attribute_uses()
    assert not breaches, "private names taken from another package:\n" + "\n".join(breaches)


def private_attribute_uses() -> list[str]:
    """``mod._name`` where ``mod`` is a popmesh module of another package bound by ``import ... as``."""
    found = []
    for importer, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        bound = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == ROOT:
                        bound[a.asname or a.name] = a.name
        own = home_package(importer)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                base = ast.unparse(node.value)
                target = bound.get(base)
                if target is not None and target != own and not target.startswith(own + "."):
                    found.append(f"{importer}:{node.lineno} uses {base}.{node.attr}")
    return found


def test_engine_libraries_only_in_engines():
    breaches = [f"{i}:{line} imports {m}" for i, m, line in external_imports()
                if m.startswith(ENGINE_MODULES) and package_of(i) != "engines"]
    assert not breaches, "\n".join(breaches)


def seed_names() -> set[str]:
    from seed_signatures import find_seeds_dir, load_seeds

    seeds = load_seeds() if find_seeds_dir() is not None else {}
    if not seeds:
        pytest.skip("the seed documents (../shared/seeds) are not visible from this checkout")
    return {entry.split(".")[0] for seed in seeds.values() for entry in seed.entries} - ENGINE_VOCABULARY


def defined_public_names(tree: ast.Module) -> dict[str, int]:
    """Module-level definitions and ``__all__`` entries: name -> line."""
    names: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node.lineno
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node.lineno
                    if target.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                        names.update({e.value: node.lineno for e in node.value.elts
                                      if isinstance(e, ast.Constant) and isinstance(e.value, str)})
    return names


def test_seed_names_live_only_in_compat():
    seeds = seed_names()
    breaches = []
    for module, path in modules().items():
        if package_of(module) == "compat":
            continue
        for name, line in defined_public_names(ast.parse(path.read_text(), str(path))).items():
            if name in seeds:
                breaches.append(f"{module}:{line} defines the seed name {name!r} (map it in compat/ instead)")
    assert not breaches, "\n".join(breaches)


def test_no_unfinished_markers():
    markers = re.compile(r"raise NotImplementedError|TODO|FIXME|XXX")
    hits = [str(p.relative_to(SRC)) for p in (SRC / ROOT).rglob("*.py") if markers.search(p.read_text())]
    assert not hits, f"unfinished markers in {hits}"


# --- the checker checks itself ---------------------------------------------------------------------


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: every strongly connected component of more than one node (a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_cycles():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_graph_sees_imports_inside_functions_and_relative_ones():
    world_edges = {e.target for e in edges() if e.importer == "popmesh.engines"}
    assert "popmesh.engines.local" in world_edges  # imported inside create_engine
    assert "popmesh.core.errors" in {e.target for e in edges() if e.importer == "popmesh.comm.world"}


def test_checker_flags_upward_sideways_root_and_private_imports():
    fake = (
        Edge("popmesh.engines.base", "popmesh.comm.world", ("Comm",), 1),  # upward
        Edge("popmesh.torch.sync", "popmesh.jax.axes", ("psum",), 2),  # sideways
        Edge("popmesh.population.mechanisms.selective", "popmesh", ("init",), 3),  # the public face from inside
        Edge("popmesh.comm.world", "popmesh.core.errors", ("ConfigError",), 4),  # fine: downward
        Edge("popmesh.comm.world", "popmesh.comm.collectives", ("_setup",), 5),  # fine: same package
    )
    assert [b.split(":")[0] for b in layer_breaches(fake)] == [
        "popmesh.engines.base", "popmesh.torch.sync", "popmesh.population.mechanisms.selective"]
    private = (
        Edge("popmesh.compat.evorl", "popmesh.jax.updates", ("_hidden",), 1),
        Edge("popmesh.comm.asynchronous", "popmesh.comm.collectives", ("_setup",), 2),
        Edge("popmesh.population.mechanisms.selective", "popmesh.engines._internal", (), 3),
    )
    flagged = [b.split(":")[0] for b in private_breaches(private)]
    assert flagged == ["popmesh.compat.evorl", "popmesh.population.mechanisms.selective"]
    inside = (
        Edge("popmesh.population.decisions.selection", "popmesh.population.state.model_state", (), 1),  # upward
        Edge("popmesh.population.state.replace", "popmesh.population.mechanisms.info", ("Clock",), 2),  # upward
        Edge("popmesh.population.decisions.options", "popmesh.population", ("Decision",), 3),  # the face
        Edge("popmesh.population.mechanisms.selective", "popmesh.population.state.replace", (), 4),  # fine
        Edge("popmesh.population", "popmesh.population.mechanisms.selective", (), 5),  # fine: the face
        Edge("popmesh.compat.gfn", "popmesh.population.decisions.selection", (), 6),  # another layer's rules
    )
    assert [b.split(":")[1].split()[0] for b in sublayer_breaches(inside)] == ["1", "2", "3"]
