"""No import cycles among clawflow modules.

Every import counts: module-level, inside a function (the usual way a cycle is dodged), and under
`TYPE_CHECKING` (a cycle in the types is the same tangle). The graph is read with `ast`, so nothing
is imported. Checked for the whole clawflow package (clawflow.store.queries types its catalog argument
with a Protocol of its own, so it does not import clawflow.store.catalog, which imports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import clawflow

ROOT = Path(clawflow.__file__).parent
SCOPE = "clawflow"  # a cycle with any module under it fails the test


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imported(module: str, path: Path) -> set[str]:
    """Dotted names `module` imports anywhere in its file; `from a import b` yields `a` and `a.b`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def owner(name: str) -> str | None:  # the clawflow module a dotted name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {o for n in _imported(m, f) if n.startswith("clawflow") and (o := owner(n)) not in (None, m)}
            for m, f in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = import_graph()
    assert graph["clawflow.serving.engine"]  # the graph sees imports at all
    bad = [c for c in cycles(graph) if any(m == SCOPE or m.startswith(SCOPE + ".") for m in c)]
    assert not bad, "import cycles: " + "; ".join(" ↔ ".join(c) for c in bad)
