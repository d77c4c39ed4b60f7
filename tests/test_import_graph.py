"""The import graph of ``src/truespec`` runs one way and has no cycle (training/ excluded).

A module may import from its own package or from packages *lower* in ``ORDER``; the leaf modules at the
bottom (config, sampling_params, ...) may be imported from anywhere and import only each other. Every import
counts, in a function body too: a lazy import that dodges a cycle is still the cycle. Run this file as a
script to print the violations and cycles instead of asserting.
"""

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "truespec"
EXCLUDED = {"training"}  # its own pipeline: it may import anything, and nothing here is checked against it
# Highest first: entrypoints -> llm / engine -> spec_decode -> structured_output -> worker -> models -> layers ->
# kernels -> cpu_kernels -> ops.
ORDER = ["entrypoints", "llm", "engine", "spec_decode", "structured_output", "worker", "core", "kv_cache", "models",
         "layers", "kernels", "cpu_kernels", "ops"]  # fmt: skip
LEAVES = {"config", "sampling_params", "outputs", "forward_context", "tokenizer", "assets", "dtypes"}
TOP = {ROOT, f"{ROOT}.__main__"}  # the package's public face and ``python -m truespec``: above everything
# Request and cache bookkeeping: plain Python, testable without torch (docs/ARCHITECTURE.md)
TORCH_FREE = ["core", "kv_cache.block_pool", "kv_cache.manager", "kv_cache.config", "kv_cache.prefix_cache",
              "kv_cache.state_checkpoints"]


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package outside EXCLUDED."""
    modules = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if len(parts) > 1 and parts[1] in EXCLUDED:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The longest known module that ``name`` starts with (``pkg.mod.func`` -> ``pkg.mod``)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imported_modules(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its file (top level or inside functions)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up level - 1 packages from this module's package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, or a name in ``base``
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == ROOT and (len(parts) == 1 or parts[1] not in EXCLUDED):
                targets.add(_resolve(name, modules))
    targets.discard(module)
    return targets


def unit_of(module: str) -> str:
    """The ORDER / LEAVES entry a module belongs to: its top-level package or module under truespec."""
    return module if module in TOP else module.split(".")[1]


def rank(unit: str) -> int:
    if unit in TOP:
        return -1
    return len(ORDER) if unit in LEAVES else ORDER.index(unit)


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def unplaced_units(graph: dict[str, set[str]]) -> set[str]:
    return {unit_of(m) for m in graph} - set(ORDER) - LEAVES - TOP


def direction_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from its own level or above (other than its own package / leaf from leaf)."""
    bad = []
    for module, targets in sorted(graph.items()):
        unit = unit_of(module)
        for target in sorted(targets):
            other = unit_of(target)
            if other == unit or (unit in LEAVES and other in LEAVES):
                continue
            if rank(other) <= rank(unit):
                bad.append(f"{module} ({unit}) imports {target} ({other})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_package_has_a_place_in_the_order(graph: dict[str, set[str]]) -> None:
    assert not unplaced_units(graph), "add these to ORDER or LEAVES in tests/test_import_graph.py"
    assert set(ORDER) <= {unit_of(m) for m in graph}


def test_imports_only_run_downward(graph: dict[str, set[str]]) -> None:
    assert direction_violations(graph) == []


def test_no_import_cycle_between_modules(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def top_level_imports(path: Path) -> set[str]:
    """The top-level names of every module ``path`` imports (``torch`` for ``torch.nn``)."""
    tree = ast.parse(path.read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
    return {m.split(".")[0] for m in imported}


def test_torch_references_import_no_triton() -> None:
    """ops/ is the triton-free home of every torch reference: the CPU path runs without triton installed."""
    for name, path in module_files().items():
        if unit_of(name) == "ops":
            assert "triton" not in top_level_imports(path), name


def test_request_bookkeeping_imports_no_torch(graph: dict[str, set[str]]) -> None:
    """The scheduler and the cache accounting are plain Python (their tests need no tensors), and so is every
    truespec module they import."""
    modules = module_files()
    roots = [m for m in modules if any(m == f"{ROOT}.{p}" or m.startswith(f"{ROOT}.{p}.") for p in TORCH_FREE)]
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph[module]
    assert len(roots) >= 6
    assert [m for m in sorted(seen) if "torch" in top_level_imports(modules[m])] == []


def test_checker_sees_lazy_imports_and_cycles(tmp_path: Path) -> None:
    """The checker itself: an import inside a function is an edge, and a two-module loop is a cycle."""
    tree = {f"{ROOT}.ops.a": {f"{ROOT}.kernels.b"}, f"{ROOT}.kernels.b": {f"{ROOT}.ops.a"}}
    assert cycles(tree) == [sorted(tree)]
    assert direction_violations(tree) == [f"{ROOT}.ops.a (ops) imports {ROOT}.kernels.b (kernels)"]
    probe = tmp_path / "x.py"
    probe.write_text("def f():\n    from truespec.layers.norm import RMSNorm\n")
    modules = {f"{ROOT}.kernels.x": probe, f"{ROOT}.layers.norm": Path("norm.py")}
    assert imported_modules(f"{ROOT}.kernels.x", probe, modules) == {f"{ROOT}.layers.norm"}


if __name__ == "__main__":
    g = import_graph()
    problems = [f"unplaced: {u}" for u in sorted(unplaced_units(g))]
    problems += direction_violations(g) + [" -> ".join(c) for c in cycles(g)]
    print("\n".join(problems) or f"{len(g)} modules: imports run downward, no cycle")
    sys.exit(1 if problems else 0)
