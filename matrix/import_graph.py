"""The package's import graph, read from the source (no module is imported): which matrix
module imports which, at module level or inside a function, and which third-party packages
each one imports. `python -m matrix.import_graph` prints it (--dot: Graphviz) and the import
circles, if any; tests/test_import_graph.py asserts there are none, and that the results
layer reaches no torch. Standard library only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


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
    print(f"\n{len(edges)} modules, {sum(map(len, edges.values()))} imports, {len(circles)} import circles")
    for circle in circles:
        print("circle: " + " -> ".join(circle))
    return 1 if circles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
