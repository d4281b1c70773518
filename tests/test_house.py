"""The house rules of the package's imports, read from the source with ast (every import: top level, inside
functions, under TYPE_CHECKING): no import cycle inside quantkit, and the kernels (quantkit.kernels, the repo's
kernels/ folder) import nothing of quantkit: they are the ground floor that the nn layer, formats and quantizers
build on; no kernel file imports another (they share kernels/common.py, gluon_common.py, layout.py, spec.py).
And the checkout imports from its own root."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"quantkit": ROOT / "quantkit", "quantkit.kernels": ROOT / "kernels"}


def _module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def _imported(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The package modules one import statement of module `name` names (`from p import m` names the submodule m
    where there is one, else p; the packages above a module, which Python initialises first, are not counted)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    base = node.module or ""
    if node.level:
        parent = name.split(".")[: len(name.split(".")) - node.level + is_package]
        base = ".".join(parent + ([node.module] if node.module else []))
    found = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules}
    if base in modules and len(found) < len(node.names):
        found.add(base)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source."""
    modules = _module_files()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[name] = set().union(*(_imported(node, name, is_package, modules) for node in ast.walk(tree)
                                    if isinstance(node, ast.Import | ast.ImportFrom))) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None: depth-first search."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    return next((c for node in sorted(graph) if node not in state and (c := visit(node))), None)


def test_find_cycle_reports_the_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kernels_import_nothing_of_quantkit() -> None:
    wrong = {f"{name} imports {dep}" for name, deps in import_graph().items() if name.startswith("quantkit.kernels")
             for dep in deps if not dep.startswith("quantkit.kernels")}
    assert not wrong, sorted(wrong)


def _declares_kernels(path: Path) -> bool:
    """Whether a module is a kernel file: it declares the KernelSpecs it registers (a top-level SPECS)."""
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SPECS" for t in node.targets)
               for node in tree.body)


def test_no_kernel_file_imports_another() -> None:
    modules = _module_files()
    kernel_files = {name for name, path in modules.items() if name.startswith("quantkit.kernels.")
                    and _declares_kernels(path)}
    assert len(kernel_files) >= 7, sorted(kernel_files)
    graph = import_graph()
    wrong = {f"{name} imports {dep}" for name in kernel_files for dep in graph[name] & kernel_files}
    assert not wrong, sorted(wrong)


def test_the_checkout_imports_from_its_own_root() -> None:
    """Python started in the repository root has kernels/ on sys.path as a top-level `kernels`: that name still
    resolves to the PyPI package transformers imports, and quantkit.kernels to the folder."""
    probe = ("import pathlib, kernels, quantkit, quantkit.kernels as ours; "
             "assert not pathlib.Path(kernels.__file__).is_relative_to(pathlib.Path.cwd()), kernels.__file__; "
             "assert pathlib.Path(ours.__file__).parent.name == 'kernels' and callable(ours.make_kernel_forward)")
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=environment, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
