"""The boundary to torch's private APIs: only `fsdp2_compile/_torch_private.py` touches them.

A private torch symbol, for the scan below, is a dotted path under `torch` with a component that starts with `_` and
is not a dunder (`torch._dynamo`, `torch.ops._c10d_functional`, `torch.distributed.tensor._utils`,
`DTensor._op_dispatcher`), however it is reached: `import`, `from ... import`, an attribute of a name an import or
an assignment bound, or `getattr(<torch path>, "_name")`.

Private attributes of objects (a tensor's `_base`, a torchao weight's `_tensor`, AOTAutograd's `_boxed_call` on a
compiled function, the `_state_ctx` torch's pipeline schedules read of an FSDP2 state) are found by what the project
owns: its private members are the names its classes define (class bodies, `self.`/`cls.` assignments) and
`_fsdp2`-prefixed marks. Outside the boundary, reading or setting another private attribute is torch's (or
torchao's), setting one of the project's own on another object is a protocol of theirs, and a private member the
project defines but never reads is one that they read.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCANNED = ("fsdp2_compile", "passes", "examples", "benchmarks")
BOUNDARY = ROOT / "fsdp2_compile" / "_torch_private.py"


NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
"""A named tuple's public methods and attributes, `_`-prefixed so as not to clash with field names."""


def _private(component: str) -> bool:
    return component.startswith("_") and not (component.startswith("__") and component.endswith("__"))


def _first_private(path: str) -> str | None:
    """`path` up to its first private component, or None if it has none."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            return ".".join(parts[: i + 1])
    return None


class _Scan(ast.NodeVisitor):
    """Private torch paths in one module, with their lines. Names bound by an import of something under torch, or by
    assigning such a path, are followed through the whole module (a function's local binding counts module-wide: a
    rare shadowing name can only make the scan stricter)."""

    def __init__(self) -> None:
        self.bound: dict[str, str] = {}  # local name -> the torch path it stands for
        self.found: list[tuple[int, str]] = []

    def _report(self, node: ast.AST, path: str) -> None:
        private = _first_private(path)
        if private is not None:
            self.found.append((node.lineno, private))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "torch" or alias.name.startswith("torch."):
                self._report(node, alias.name)
                if alias.asname:
                    self.bound[alias.asname] = alias.name
                else:
                    self.bound["torch"] = "torch"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and (module == "torch" or module.startswith("torch.")):
            for alias in node.names:
                path = f"{module}.{alias.name}"
                self._report(node, path)
                self.bound[alias.asname or alias.name] = path

    def bind(self, node: ast.Assign) -> None:
        """`name = <torch path>` (or `a, b = <path>, <path>`) makes `name` stand for that path too."""
        for target in node.targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts))
            for name, value in pairs:
                path = self._path(value)
                if isinstance(name, ast.Name) and path is not None:
                    self.bound[name.id] = path

    def _path(self, node: ast.AST) -> str | None:
        """The torch path an expression of names and attributes stands for, if it starts at a torch name."""
        if isinstance(node, ast.Name):
            return self.bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._path(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        base = self._path(node.value)
        if base is not None and _first_private(base) is None:  # report a path once, at its first private part
            self._report(node, f"{base}.{node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
            base, name = self._path(node.args[0]), node.args[1]
            if base is not None and isinstance(name, ast.Constant) and isinstance(name.value, str):
                if _first_private(base) is None:
                    self._report(node, f"{base}.{name.value}")
        self.generic_visit(node)


def _private_name(node: ast.Call) -> str | None:
    """The private name `getattr(obj, "_name")` (or has/set/delattr) names, if it is one."""
    fn, args = node.func, node.args
    if isinstance(fn, ast.Name) and fn.id in ("getattr", "hasattr", "setattr", "delattr") and len(args) >= 2:
        if isinstance(args[1], ast.Constant) and isinstance(args[1].value, str) and _private(args[1].value):
            return args[1].value
    return None


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _members(tree: ast.AST) -> dict[str, int]:
    """The names `tree`'s classes define as members (class-body assignments and functions, `self.`/`cls.`
    assignments), with a line of each."""
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names = [item.name]
                for name in names:
                    found.setdefault(name, item.lineno)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
            found.setdefault(node.attr, node.lineno)
    return found


def _project_modules(tree: ast.AST) -> set[str]:
    """Names `tree` binds to the project's own modules (`from fsdp2_compile.runtime import sharding`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("fsdp2_compile", "passes"):
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name.split(".")[0] == "fsdp2_compile"}
    return names


def private_attribute_uses(sources: dict[str, str]) -> list[str]:
    """ "path:line: what" for each private attribute of another library's object that `sources` (path -> source)
    read, set or define for it to read (see the module docstring)."""
    trees = {path: ast.parse(source) for path, source in sources.items()}
    members = {name for tree in trees.values() for name in _members(tree)}
    read = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Attribute, ast.Name)) and isinstance(node.ctx, ast.Load):
                read.add(node.attr if isinstance(node, ast.Attribute) else node.id)
            elif isinstance(node, ast.Call) and _private_name(node):
                read.add(_private_name(node))
    found = []
    for path, tree in trees.items():
        modules = _project_modules(tree)
        for node in ast.walk(tree):
            attribute = isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in NAMEDTUPLE_API
            if attribute and not _on_self(node):
                if isinstance(node.value, ast.Name) and node.value.id in modules:
                    continue
                if node.attr not in members and not node.attr.startswith("_fsdp2"):
                    found.append(f"{path}:{node.lineno}: .{node.attr} is not the project's")
                elif isinstance(node.ctx, ast.Store) and not node.attr.startswith("_fsdp2"):
                    found.append(f"{path}:{node.lineno}: .{node.attr} set on another object")
            elif isinstance(node, ast.Call) and _private_name(node):
                name = _private_name(node)
                if name not in members and not name.startswith("_fsdp2"):
                    found.append(f"{path}:{node.lineno}: {node.func.id}(..., {name!r}) is not the project's")
        for name, line in _members(tree).items():
            if _private(name) and name not in read:
                found.append(f"{path}:{line}: {name} is defined for another library to read")
    return sorted(found)


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, private torch path) for each use in `source`, in line order."""
    tree = ast.parse(source)
    scan = _Scan()
    for node in ast.walk(tree):  # first, so that a function's lazy import binds its names above it in the file too
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            scan.visit(node)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            scan.bind(node)
    scan.visit_Import = scan.visit_ImportFrom = lambda node: None
    scan.visit(tree)
    return sorted(set(scan.found))


def _scanned_files() -> list[pathlib.Path]:
    files = []
    for top in SCANNED:
        files += sorted((ROOT / top).rglob("*.py"))
    return [f for f in files if f != BOUNDARY]


def test_no_private_torch_outside_boundary():
    uses = [
        f"{f.relative_to(ROOT)}:{line}: {path}"
        for f in _scanned_files()
        for line, path in private_torch_uses(f.read_text())
    ]
    assert not uses, "private torch APIs used outside fsdp2_compile/_torch_private.py (wrap them there):\n" + "\n".join(
        uses
    )


def test_no_private_attribute_of_torch_objects_outside_boundary():
    sources = {str(f.relative_to(ROOT)): f.read_text() for f in _scanned_files()}
    uses = private_attribute_uses(sources)
    assert not uses, (
        "private attributes of torch's (or torchao's) objects outside fsdp2_compile/_torch_private.py:\n"
        + ("\n".join(uses))
    )


def test_attribute_scan_finds_every_form():
    source = textwrap.dedent("""
        from fsdp2_compile.runtime import sharding

        class Mine:
            _cached = None

            def __init__(self):
                self._items = []

            def run(self, weight, fn, other):
                fn._boxed_call = True
                self._items.append(weight._tensor)
                getattr(weight, "_linear_mm_config")
                other._items, other._fsdp2_mark = [], True
                return sharding._trace_blocks_once, self._cached

        class Protocol:
            @property
            def _state_ctx(self):
                return None
    """)
    assert private_attribute_uses({"m.py": source}) == [
        "m.py:11: ._boxed_call is not the project's",
        "m.py:12: ._tensor is not the project's",
        "m.py:13: getattr(..., '_linear_mm_config') is not the project's",
        "m.py:14: ._items set on another object",
        "m.py:19: _state_ctx is defined for another library to read",
    ]


def test_scan_finds_every_form():
    source = textwrap.dedent("""
        import torch
        import torch.distributed as dist
        import torch._dynamo
        from torch import fx
        from torch._guards import detect_fake_mode
        from torch.distributed.tensor import DTensor
        from torch.utils import _pytree
        aten, funcol = torch.ops.aten, torch.ops._c10d_functional

        def f(t, mod):
            from torch.fx.graph import _BoxedCodeGen
            torch._C.DisableTorchFunctionSubclass()
            dist.distributed_c10d._resolve_process_group("0")
            aten._to_copy.default
            DTensor._op_dispatcher
            getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
            fx.graph._BoxedCodeGen
            torch.ops.aten.mm.default, torch.Tensor.__add__, dist.all_reduce, t._base, mod._parameters
    """)
    assert private_torch_uses(source) == [
        (4, "torch._dynamo"),
        (6, "torch._guards"),
        (8, "torch.utils._pytree"),
        (9, "torch.ops._c10d_functional"),
        (12, "torch.fx.graph._BoxedCodeGen"),
        (13, "torch._C"),
        (14, "torch.distributed.distributed_c10d._resolve_process_group"),
        (15, "torch.ops.aten._to_copy"),
        (16, "torch.distributed.tensor.DTensor._op_dispatcher"),
        (17, "torch._C"),
        (18, "torch.fx.graph._BoxedCodeGen"),
    ]


def test_missing_private_symbol_names_it_and_the_supported_range():
    from fsdp2_compile import _torch_private

    for path, named in (
        ("torch._dynamo:no_such_function", "torch._dynamo.no_such_function"),
        ("torch._no_such_module:anything", "torch._no_such_module.anything"),
        ("torch.ops:_c10d_functional.no_such_collective", "torch.ops._c10d_functional.no_such_collective"),
    ):
        with pytest.raises(_torch_private.UnsupportedTorchError) as raised:
            _torch_private._resolve(path)
        message = str(raised.value)
        assert f"`{named}`" in message and f"torch{_torch_private.SUPPORTED_TORCH_SPEC}" in message, message


def test_version_check(monkeypatch):
    from fsdp2_compile import _torch_private

    monkeypatch.delenv(_torch_private.ALLOW_UNSUPPORTED_TORCH, raising=False)
    (major, first), (_, after) = _torch_private.SUPPORTED_TORCH
    last = after - 1
    for supported in (
        f"{major}.{first}.0",
        f"{major}.{first}.0+cpu",
        f"{major}.{first}.2+cu128",
        f"{major}.{first}.0a0+git1234567",
        f"{major}.{last}.1",
        f"{major}.{last}.0+cu132",
    ):
        _torch_private.check_torch_version(supported)
    newer = f"{major}.{after}.0"
    for unsupported in (f"{major}.{first - 1}.1", newer, f"{newer}.dev20270101+cpu", f"{major + 1}.0.0", "unknown"):
        with pytest.raises(_torch_private.UnsupportedTorchError, match=re.escape(_torch_private.SUPPORTED_TORCH_SPEC)):
            _torch_private.check_torch_version(unsupported)
    monkeypatch.setenv(_torch_private.ALLOW_UNSUPPORTED_TORCH, "1")
    with pytest.warns(UserWarning, match=re.escape(f"torch {newer} is not supported")):
        _torch_private.check_torch_version(newer)


@pytest.mark.parametrize("allow", [False, True])
def test_import_checks_the_installed_torch(allow):
    """Importing the boundary checks torch's version: an error (exit status 1) for an unsupported one, a warning
    with the opt-out set."""
    env = {k: v for k, v in os.environ.items() if k != "FSDP2_COMPILE_ALLOW_UNSUPPORTED_TORCH"}
    if allow:
        env["FSDP2_COMPILE_ALLOW_UNSUPPORTED_TORCH"] = "1"
    from fsdp2_compile._torch_private import SUPPORTED_TORCH

    newer = f"{SUPPORTED_TORCH[1][0]}.{SUPPORTED_TORCH[1][1]}.0"
    code = f"import torch; torch.__version__ = '{newer}'; import fsdp2_compile._torch_private"
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert f"torch {newer} is not supported" in done.stderr, done.stderr
    assert done.returncode == (0 if allow else 1), done.stderr
    assert ("UnsupportedTorchError" in done.stderr) is not allow


def test_supported_range_is_the_one_pyproject_pins():
    from fsdp2_compile import _torch_private

    with open(ROOT / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    torch_pins = [d for d in dependencies if d.replace(" ", "").startswith("torch") and d[5:6] in "<>=!~ ["]
    assert [p.replace(" ", "") for p in torch_pins] == [f"torch{_torch_private.SUPPORTED_TORCH_SPEC}"]


def test_torchao_version_check(monkeypatch):
    from fsdp2_compile import _torch_private

    monkeypatch.delenv(_torch_private.ALLOW_UNSUPPORTED_TORCH, raising=False)
    _torch_private.check_torchao_version("0.18.0")
    _torch_private.check_torchao_version("0.18.1+cpu")
    for unsupported in ("0.17.0", "0.19.0", "1.0.0", "unknown"):
        with pytest.raises(_torch_private.UnsupportedTorchError, match=r"torchao>=0\.18,<0\.19"):
            _torch_private.check_torchao_version(unsupported)
    monkeypatch.setenv(_torch_private.ALLOW_UNSUPPORTED_TORCH, "1")
    with pytest.warns(UserWarning, match=r"torchao 0\.19\.0 is not supported"):
        _torch_private.check_torchao_version("0.19.0")
