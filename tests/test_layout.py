"""The package's layout: imports point down the floors and no module imports itself back, at any level.

Every `import` in `fsdp2_compile/` and `passes/` is read with `ast` (those inside functions too): the module graph
must be acyclic, and a module may import only modules on its own floor or below (`FLOORS`, lowest first).
"""

from __future__ import annotations

import ast
import os

import networkx as nx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLOORS = (
    ("_torch_private",),
    ("config",),
    ("core",),
    ("runtime",),
    ("compiler", "passes"),
    ("debug",),
    ("api", "checkpoint"),
    ("planner",),
    ("cli",),
    ("__init__", "__main__"),
)
"""Each module's floor is that of its first name under `fsdp2_compile` (its sub-package or top-level module)."""


def _modules() -> dict[str, str]:
    """Dotted module name -> path, for the package and its passes (installed as `fsdp2_compile.passes`)."""
    found = {}
    for folder, prefix in (("fsdp2_compile", "fsdp2_compile"), ("passes", "fsdp2_compile.passes")):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            package = prefix if rel == "." else f"{prefix}.{rel.replace(os.sep, '.')}"
            for f in files:
                if f.endswith(".py"):
                    name = package if f == "__init__.py" else f"{package}.{f[:-3]}"
                    found[name] = os.path.join(dirpath, f)
    return found


def import_graph() -> nx.DiGraph:
    """Module -> the package modules it imports (the deepest existing module each import names)."""
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        is_package = path.endswith("__init__.py")
        for node in ast.walk(ast.parse(open(path).read(), path)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".")[: len(name.split(".")) - node.level + is_package]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not (is_package and target == name):
                    graph.add_edge(name, target)
                    break
    return graph


def _floor(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return next(i for i, names in enumerate(FLOORS) if top in names)


def test_every_module_has_a_floor():
    assert all(_floor(m) >= 0 for m in import_graph())


def test_no_import_cycles_at_any_level():
    cycles = sorted(nx.simple_cycles(import_graph()), key=len)
    assert not cycles, "import cycles (function-level imports included):\n" + "\n".join(
        " -> ".join([*c, c[0]]) for c in cycles[:10]
    )


def test_imports_point_down_the_floors():
    graph = import_graph()
    up = [
        f"{a} (floor {FLOORS[_floor(a)]}) imports {b} (floor {FLOORS[_floor(b)]})"
        for a, b in graph.edges
        if _floor(b) > _floor(a)
    ]
    assert not up, "imports that point up:\n" + "\n".join(sorted(up))


def test_every_import_of_the_package_names_a_module_that_exists():
    # the tests' rank workers, the benchmarks and the examples import modules by path too: a stale path would only
    # fail inside a spawned rank or a benchmark run
    import fsdp2_compile

    modules = _modules()
    stale = []
    for folder in ("fsdp2_compile", "passes", "tests", "benchmarks", "examples"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in (f for f in files if f.endswith(".py")):
                path = os.path.join(dirpath, f)
                for node in ast.walk(ast.parse(open(path).read(), path)):
                    if isinstance(node, ast.Import):
                        names = [a.name for a in node.names if a.name.startswith("fsdp2_compile.")]
                    elif isinstance(node, ast.ImportFrom) and not node.level and node.module == "fsdp2_compile":
                        names = [f"fsdp2_compile.{a.name}" for a in node.names if a.name not in fsdp2_compile.__all__]
                    elif (
                        isinstance(node, ast.ImportFrom)
                        and not node.level
                        and (node.module or "").startswith("fsdp2_compile.")
                    ):
                        names = [node.module]
                    else:
                        continue
                    where = f"{os.path.relpath(path, ROOT)}:{node.lineno}"
                    stale += [f"{where}: {name}" for name in names if name not in modules]
    assert not stale, "imports of modules that do not exist:\n" + "\n".join(stale)
