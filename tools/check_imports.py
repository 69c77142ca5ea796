"""Fail when warmstart's modules import each other in a cycle (run by ``make lint``).

Every import counts: at module level, inside a function, and under ``TYPE_CHECKING``. An import put
inside a function to dodge a cycle hides it from readers, not from this check: break a cycle by
moving what both modules need into a module below them. Prints each cycle as the modules in it and
the imports between them (file and line), and exits 1; exits 0 when there is none.

Usage: ``python tools/check_imports.py`` from the repository root.
"""

from __future__ import annotations

import sys

import grimp

PACKAGE = "warmstart"

#: (importer, imported) -> why the import must stay although it closes a cycle. Only for an import
#: made lazily on purpose (start-up time, a process that must not load a module), never for one
#: that could move down a layer.
LAZY_IMPORTS: dict[tuple[str, str], str] = {}


def cycles(graph: grimp.ImportGraph, ignored: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan's algorithm,
    iterative: the graph is deep enough to exceed Python's recursion limit)."""
    edges = {
        module: sorted(m for m in graph.find_modules_directly_imported_by(module) if (module, m) not in ignored)
        for module in graph.modules
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            targets = edges[node]
            if i < len(targets):
                work.append((node, i + 1))
                target = targets[i]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sorted(found)


def _describe(graph: grimp.ImportGraph, component: list[str], ignored: set[tuple[str, str]]) -> list[str]:
    lines = [" <-> ".join(component)]
    members = set(component)
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            if (importer, imported) in ignored:
                continue
            for detail in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"    {importer} -> {imported} (line {detail['line_number']}: {detail['line_contents']})")
    return lines


def main() -> int:
    graph = grimp.build_graph(PACKAGE)
    allowed = dict(LAZY_IMPORTS)
    made = {(a, b) for a, b in allowed if a in graph.modules and b in graph.find_modules_directly_imported_by(a)}
    stale = [f"{a} -> {b}" for a, b in allowed if (a, b) not in made]
    found = cycles(graph, set(allowed))
    for component in found:
        print("\n".join(_describe(graph, component, set(allowed))))
    for entry in stale:
        print(f"allowed import no longer made (remove it from tools/check_imports.py): {entry}")
    if found:
        print(f"{len(found)} import cycle(s) among {PACKAGE}'s modules: move what both sides need down a layer")
    return 1 if found or stale else 0


if __name__ == "__main__":
    sys.exit(main())
