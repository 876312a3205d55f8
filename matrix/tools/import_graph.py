"""The package's import graph, read from the source (no module is imported): which matrix
module imports which, at module level or inside a function, and which third-party packages
each one imports. `python -m matrix.tools.import_graph` prints it (--dot: Graphviz) and the import
circles, if any; tests/test_import_graph.py asserts there are none, and that the results
layer reaches no torch. Standard library only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """(matrix modules, top-level third-party packages) that the file imports anywhere in it.
    `from matrix.a import b` counts as an import of matrix.a.b where that is a module."""
    inner, outer = set(), set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            if name == "matrix" or name.startswith("matrix."):
                inner.add(name)
            elif name:
                outer.add(name.split(".")[0])
    return inner, outer


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """module -> matrix modules it imports; module -> third-party packages it imports."""
    found = modules()
    known = set(found)
    edges, external = {}, {}
    for name, path in found.items():
        inner, outer = imports_of(path, known)
        edges[name] = {m for m in inner if m != name}
        external[name] = outer
    return edges, external


# the package's folders, bottom to top: a module may import a module of its own folder or of a folder
# below it, never one above (tests/test_import_graph.py). matrix/__init__.py and __main__.py sit above
# them all.
LAYERS = (
    "grid",  # what a cell is: its axes, the registry, the grid's constant settings, the schedule
    "results",  # torch-free: records, signatures, curves' records, every report format
    "shards",  # a run split across machines, and the merge of their reports
    "checks",  # what a cell asserts and within which tolerances
    "precisions",  # the precision policies, float8 and quantized bases
    "devices",  # one file per device, and the machine's fingerprint
    "models",  # one file per model kind; what the harness observes of a kind
    "harness",  # the pipeline's phases, the cell's state, measurements, resume, a kind's one-time work
    "engines",  # one file per engine, the libraries several share
    "selection",  # the grid enumerated over the registries, --model a,b, the cell a test id names
    "catalogue",  # known failures, their selectors and conditions
    "execute",  # running a cell: in this process or in the ranks of a process group
    "explore",  # hypothesis exploration of variants the grid does not run
    "run",  # python -m matrix run: the crash-surviving supervisor, and the options it shares with the plugin
    "plugin",  # pytest: hooks, fixtures, the matrix's two tests
    "releases",  # stacks, sweeps, bisection, standalone scripts and triage
    "tools",  # benchmarks, this import graph, the curve spread's measurement
)


def layer_of(module: str) -> str | None:
    """The folder a module belongs to (None for matrix/__init__ and __main__, above every layer)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def upward_imports(edges: dict[str, set[str]], layers: tuple[str, ...] = LAYERS) -> list[tuple[str, str]]:
    """(importer, imported) for every import that points from a folder to a folder above it, and every
    module outside the folders other than matrix/__init__ and __main__."""
    rank = {name: i for i, name in enumerate(layers)}
    found = []
    for source in sorted(edges):
        parts = source.split(".")
        if len(parts) > 1 and parts[1] not in rank and parts[1] != "__main__":
            found.append((source, "<no layer>"))
            continue
        if len(parts) < 2 or parts[1] == "__main__":
            continue
        for target in sorted(edges[source]):
            target_parts = target.split(".")
            if len(target_parts) < 2:
                continue  # the package itself: its __init__ is the map
            if target_parts[1] in rank and rank[target_parts[1]] > rank[parts[1]]:
                found.append((source, target))
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every matrix module importing `start` may import, itself included (parent packages too:
    importing matrix.a.b runs matrix/a/__init__.py first)."""
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        parents = [".".join(node.split(".")[:i]) for i in range(1, node.count(".") + 1)]
        todo += [*edges.get(node, ()), *parents]
    return seen


def main(argv: list[str]) -> int:
    edges, external = graph()
    if "--dot" in argv:
        print("digraph matrix {")
        for source in sorted(edges):
            for target in sorted(edges[source]):
                print(f'  "{source}" -> "{target}";')
        print("}")
    else:
        for source in sorted(edges):
            third = ", ".join(sorted(external[source] & {"torch", "transformers", "peft", "accelerate", "lightning"}))
            print(f"{source} -> {', '.join(sorted(edges[source])) or '-'}" + (f"   [{third}]" if third else ""))
    circles = cycles(edges)
    upward = upward_imports(edges)
    for source, target in upward:
        print(f"upward import: {source} -> {target}")
    print(f"\n{len(edges)} modules, {sum(map(len, edges.values()))} imports, {len(circles)} import circles")
    for circle in circles:
        print("circle: " + " -> ".join(circle))
    return 1 if circles or upward else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
