"""The package structure: dependencies flow one way (fuse -> model -> kernels, fuse -> kernels) and
no module imports another that imports it back, directly or around a circle."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).parents[1]
PACKAGES = ("fuse", "kernels", "model")
# Which top-level packages each package may import.
ALLOWED = {"fuse": {"fuse", "model", "kernels"}, "model": {"model", "kernels"}, "kernels": {"kernels"}}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).glob("**/*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The project modules `name` imports (`from a.b import c` is a.b.c where that is a module)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            candidates = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                out.add(candidate)
                break
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_dependencies_flow_one_way():
    wrong = [
        f"{name} imports {target}"
        for name, targets in graph().items()
        for target in targets
        if target.split(".")[0] not in ALLOWED[name.split(".")[0]]
    ]
    assert not wrong, wrong


def test_no_import_circles():
    """Package __init__ files only re-export; their edges are left out (importing a.b runs a's
    __init__ first whatever a.b imports)."""
    known = modules()
    edges = {
        name: {t for t in targets if known[t].name != "__init__.py"}
        for name, targets in graph().items()
        if known[name].name != "__init__.py"
    }
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not circles, [" -> ".join(c) for c in circles]


def test_the_walk_sees_imports():
    """The checks above can fail: the walk finds the edges that exist."""
    edges = graph()
    assert "fuse.options" in edges["fuse.runner"]
    assert any(t.startswith("kernels") for t in edges["model.hyper"])
