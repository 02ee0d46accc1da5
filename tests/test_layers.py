"""Package layering: which of our packages may import which, and no import cycles.

Allowed import directions, lowest layer first (a layer is a top-level package, except
`spotlight.core`, which is a layer of its own):

    spotlight.core  imports none of our packages
    planners        imports none of our packages
    spot            may import spotlight.core and planners
    spotlight       may import spotlight.core, spot and planners (the DiT path)
    vlm             may import spotlight.core (the VLM path)

and above them all the command line, `spotlight.cli` (`TOP`), which may import every package: it
dispatches `spotlight vlm ...` and `spotlight memory` to either path.

Every `import` statement counts, wherever it is in the file (inside a function, under
`if TYPE_CHECKING:`): a lazy import still makes the importing module depend on the imported one.
Nor may modules import each other, directly or through others (an import cycle).

The source is read with `ast` and nothing is imported, so the whole check takes a fraction of a
second. What breaks the rules today is listed in `KNOWN_EXCEPTIONS` and `KNOWN_CYCLES`; an entry
that no longer exists fails the test too, so that the lists only shrink.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CORE = "spotlight.core"

ALLOWED: dict[str, frozenset[str]] = {
    CORE: frozenset(),
    "planners": frozenset(),
    "spot": frozenset({CORE, "planners"}),
    "spotlight": frozenset({CORE, "spot", "planners"}),
    "vlm": frozenset({CORE}),
}
"""Layer -> the other layers of ours it may import (see the module docstring)."""

TOP: frozenset[str] = frozenset({"spotlight.cli"})
"""Modules above every package: they may import any of ours (and, by the cycle check, none imports them back)."""

# Module edges (importer, imported) that break `ALLOWED` today; the core refactor removes them.
# No entry may have a `spot` module as the importer.
KNOWN_EXCEPTIONS: frozenset[tuple[str, str]] = frozenset()

# Import cycles (strongly connected modules) that exist today, all outside `spot`; the core
# refactor removes them. No entry may hold a `spot` module.
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()

PACKAGES = ("planners", "spot", "spotlight", "vlm")
"""The top-level packages whose source is read (spotlight.core lies inside spotlight)."""


def module_name(path: Path, root: Path) -> str:
    """Dotted module name of a source file under `root` (a package's `__init__.py` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Absolute dotted names imported anywhere in `tree`, relative imports resolved.

    `from a.b import c` gives "a.b.c": `c` may be a submodule or a name defined in `a.b`, and
    `resolve` falls back to "a.b" when there is no module "a.b.c".
    """
    # The package a relative import is relative to: a package's own name, else its parent's.
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    raise ValueError(f"{module}: relative import beyond the top-level package (level {node.level})")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            names.update(base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names)
    return names


def resolve(name: str, modules: Iterable[str] | Mapping[str, object]) -> str | None:
    """The module `name` refers to: itself if a module, else its longest prefix that is one; or None."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports (no self-edges), read from source with `ast`."""
    files: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            files[module_name(path, root)] = path
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = set()
        for name in imported_names(tree, module, path.name == "__init__.py"):
            target = resolve(name, files)
            if target is not None and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


@functools.cache
def repo_graph() -> dict[str, set[str]]:
    """`import_graph()` of this checkout, read once for all the tests here."""
    return import_graph()


def top(module: str) -> str:
    """The layer of a dotted module name: `spotlight.core` for it and its modules, else the top-level package."""
    if module == CORE or module.startswith(CORE + "."):
        return CORE
    return module.partition(".")[0]


def forbidden_edges(
    graph: Mapping[str, Iterable[str]], allowed: Mapping[str, frozenset[str]] = ALLOWED
) -> set[tuple[str, str]]:
    """Edges (importer, imported) from one package to another that `allowed` does not permit."""
    return {
        (src, dst)
        for src, dsts in graph.items()
        for dst in dsts
        if src not in TOP and top(src) != top(dst) and top(dst) not in allowed[top(src)]
    }


def cycles(graph: Mapping[str, Iterable[str]]) -> set[frozenset[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: set[frozenset[str]] = set()
    for start in sorted(graph):
        if start in index:
            continue
        # Each frame: a node and an iterator over the successors still to visit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.add(frozenset(component))
    return found


def layering_problems(
    graph: Mapping[str, Iterable[str]],
    allowed: Mapping[str, frozenset[str]] = ALLOWED,
    known: frozenset[tuple[str, str]] = KNOWN_EXCEPTIONS,
) -> list[str]:
    """One line per forbidden edge not in `known`, and per entry of `known` that is gone."""
    found = forbidden_edges(graph, allowed)
    return [
        f"{a} -> {b}: {top(a)} may import "
        + (f"only {', '.join(sorted(allowed[top(a)]))}" if allowed[top(a)] else "none of our packages")
        for a, b in sorted(found - known)
    ] + [f"{a} -> {b}: gone, delete it from KNOWN_EXCEPTIONS" for a, b in sorted(known - found)]


def cycle_problems(graph: Mapping[str, Iterable[str]], known: frozenset[frozenset[str]] = KNOWN_CYCLES) -> list[str]:
    """One line per import cycle not in `known`, and per entry of `known` that no longer exists as listed."""
    found = cycles(graph)
    return [
        f"cycle {_show(c)} via " + ", ".join(sorted(f"{a} -> {b}" for a in c for b in graph[a] if b in c))
        for c in sorted(found - known, key=sorted)
    ] + [f"cycle {_show(c)}: gone or changed, update KNOWN_CYCLES" for c in sorted(known - found, key=sorted)]


def _show(modules: Iterable[str]) -> str:
    return "{" + ", ".join(sorted(modules)) + "}"


def test_checks_catch_a_synthetic_violation():
    """The checks themselves, on a made-up graph: they can fail, and only where they should."""
    graph = {
        "planners.a": {"planners.b"},
        "planners.b": set(),
        "spot.x": {"planners.a", "spotlight.y"},  # spot -> spotlight: forbidden
        "spotlight.y": {"spot.x", "spotlight.z"},
        "spotlight.z": {"spotlight.y"},
        "vlm.w": {"spotlight.core.k"},
        "spotlight.core.k": set(),
        "planners.c": {"vlm.w"},  # planners -> vlm: forbidden
    }
    assert forbidden_edges(graph) == {("spot.x", "spotlight.y"), ("planners.c", "vlm.w")}
    # The core is a layer of its own, below spotlight: vlm may import it and nothing else of ours.
    assert forbidden_edges(
        {"vlm.w": {"spotlight.core.k", "spotlight.y", "spot.x"}, "spotlight.core.k": {"planners.b"}}
    ) == {("vlm.w", "spotlight.y"), ("vlm.w", "spot.x"), ("spotlight.core.k", "planners.b")}
    # The command line sits above every package; another spotlight module may not import vlm.
    assert forbidden_edges({"spotlight.cli": {"vlm.w"}, "spotlight.y": {"vlm.w"}, "vlm.w": set()}) == {
        ("spotlight.y", "vlm.w")
    }
    assert cycles(graph) == {frozenset({"spot.x", "spotlight.y", "spotlight.z"})}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"d"}}) == set()
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "a"}}) == {frozenset("ab"), frozenset("cd")}
    # A long ring: the walk is iterative, so depth is no limit.
    ring = {f"m{i}": {f"m{i + 1}"} for i in range(5000)}
    ring["m5000"] = {"m0"}
    assert cycles(ring) == {frozenset(ring)}
    # Listed problems pass; a stale entry fails, as does one more edge or cycle.
    assert not layering_problems(graph, known=frozenset(forbidden_edges(graph)))
    assert layering_problems(graph, known=frozenset({("planners.c", "vlm.w")})) == [
        "spot.x -> spotlight.y: spot may import only planners, spotlight.core"
    ]
    stale = frozenset(forbidden_edges(graph) | {("spot.x", "vlm.w")})
    assert layering_problems(graph, known=stale) == ["spot.x -> vlm.w: gone, delete it from KNOWN_EXCEPTIONS"]
    assert not cycle_problems(graph, known=frozenset(cycles(graph)))
    assert cycle_problems(graph, known=frozenset()) == [
        "cycle {spot.x, spotlight.y, spotlight.z} via spot.x -> spotlight.y, spotlight.y -> spot.x, "
        "spotlight.y -> spotlight.z, spotlight.z -> spotlight.y"
    ]
    assert cycle_problems(graph, known=frozenset({frozenset({"spot.x", "spotlight.y"})})) == [
        "cycle {spot.x, spotlight.y, spotlight.z} via spot.x -> spotlight.y, spotlight.y -> spot.x, "
        "spotlight.y -> spotlight.z, spotlight.z -> spotlight.y",
        "cycle {spot.x, spotlight.y}: gone or changed, update KNOWN_CYCLES",
    ]


def test_relative_imports_resolve():
    tree = ast.parse("from . import a\nfrom ..b import c\nfrom .d.e import f\nimport x.y\n")
    assert imported_names(tree, "p.q.r", is_package=False) == {"p.q.a", "p.b.c", "p.q.d.e.f", "x.y"}
    assert imported_names(ast.parse("from . import a"), "p.q", is_package=True) == {"p.q.a"}
    modules = {"p.q", "p.q.d.e", "p.b"}
    assert [resolve(n, modules) for n in ("p.q.d.e.f", "p.b.c", "p.q.a", "x.y")] == ["p.q.d.e", "p.b", "p.q", None]


def test_imports_follow_the_layers():
    graph = repo_graph()
    assert {top(m) for m in graph} == set(ALLOWED), "a layer was not found; is ROOT right?"
    assert not any(top(src) == "spot" for src, _ in KNOWN_EXCEPTIONS), "spot may have no exception"
    problems = layering_problems(graph)
    assert not problems, (
        "imports against the layering (docs/architecture.md, Layering: move what is needed down a layer):\n  "
        + "\n  ".join(problems)
    )


def test_no_import_cycles():
    graph = repo_graph()
    assert not any(top(m) == "spot" for c in KNOWN_CYCLES for m in c), "spot may have no known cycle"
    problems = cycle_problems(graph)
    assert not problems, "import cycles (move the shared part into a module both can import):\n  " + "\n  ".join(
        problems
    )
