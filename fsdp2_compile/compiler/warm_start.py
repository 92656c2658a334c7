"""Warm restarts (`CompileConfig.cache_dir`): a module's first call is compiled through torch's ahead-of-time
compile and saved, one file per rank; a relaunch that finds the file of the same key on every rank loads it and
neither traces nor compiles (Dynamo, AOTAutograd, the partition and the passes all skipped). Whether every rank
loaded is agreed at the first call (`first_call.py`), where a rank without `cache_dir` among ranks with it is named.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import logging
import os
import sys
import tempfile
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2_compile._torch_private import (
    aot_compile_function,
    aot_function_from_bytes,
    aot_function_to_bytes,
)
from fsdp2_compile.compiler import first_call
from fsdp2_compile.compiler.graph_records import dump_requested
from fsdp2_compile.config import CompileConfig
from fsdp2_compile.runtime.param_state import ParamInfo, own_parameters
from fsdp2_compile.runtime.traced_blocks import compiling_ahead_of_time

__all__ = ["WarmStart", "cache_events", "input_guards_only"]

log = logging.getLogger("fsdp2_compile")

MAGIC = b"fsdp2-compile ahead-of-time 1\n"
_EVENTS: list[tuple[str, str]] = []


def cache_events() -> list[tuple[str, str]]:
    """(what, file) for each cache file this process looked for: "hit" (loaded, every rank loaded its own),
    "miss" (compiled), "stored", "unreadable" (warned, compiled again), "unstored" (warned), "uncompiled" (the
    ahead-of-time compile raised: warned, the module's ordinary compile runs)."""
    return list(_EVENTS)


def input_guards_only(entries: Sequence[Any]) -> list[bool]:
    """The Dynamo guards saved: global state, symbolic shapes and the call's tensor inputs; none on the module,
    whose state the key and `WarmStart`'s spec check cover."""
    return [
        e.guard_type in ("GLOBAL_STATE", "SHAPE_ENV")
        or (e.guard_type == "TENSOR_MATCH" and not e.is_global and not e.name.startswith("module"))
        for e in entries
    ]


def tree_leaves(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in tree_leaves(v)]
    if isinstance(value, dict):
        return [leaf for k in sorted(value, key=repr) for leaf in tree_leaves(value[k])]
    return [value]


Places = Sequence[tuple[nn.Module, str, ParamInfo]]


def _specs(places: Places) -> tuple:
    """What the traced graph baked in of each managed parameter: its `ParamSpec` and whether it requires grad."""
    return tuple((info.spec(), own_parameters(mod)[name].requires_grad) for mod, name, info in places)


def _modes(module: nn.Module) -> tuple[bool, ...]:
    """Each submodule's `training` flag, which the traced graph baked in (dropout, batch norm)."""
    return tuple(m.training for m in module.modules())


def _sync_flags(places: Places) -> tuple:
    return tuple((info.requires_gradient_sync, info.requires_all_reduce) for _, _, info in places)


def _tensor_text(t: torch.Tensor) -> str:
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        return (
            f"DTensor {tuple(t.shape)} {t.dtype} {t.requires_grad} mesh {mesh.mesh.tolist()} "
            f"{mesh.mesh_dim_names} {t.placements} local {tuple(t.to_local().shape)}"
        )
    return f"{tuple(t.shape)} {t.stride()} {t.dtype} {t.device} {t.requires_grad}"


def _code_digest(code: types.CodeType) -> str:
    """A digest of what `code` does: its bytecode, names and constants (nested code by digest), not where it is
    (file, lines) nor how `marshal` would write it (which depends on reference counts)."""
    consts = [
        _code_digest(c)
        if isinstance(c, types.CodeType)
        else repr(sorted(map(repr, c)) if isinstance(c, frozenset) else c)
        for c in code.co_consts
    ]
    text = repr((code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, consts))
    return hashlib.sha256(text.encode()).hexdigest()


def _code_text(module: nn.Module) -> list[str]:
    """A digest of the code of every class of `module`'s submodules (their own functions), torch's left out
    (its version is in the key)."""
    classes = {
        c for m in module.modules() for c in type(m).__mro__ if not c.__module__.startswith(("torch", "builtins"))
    }
    out = []
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
        h = hashlib.sha256()
        for name, value in sorted(vars(cls).items()):
            code = getattr(getattr(value, "fget", value), "__code__", None)
            if code is not None:
                h.update(f"{name} {_code_digest(code)}".encode())
        out.append(f"class {cls.__module__}.{cls.__qualname__} {h.hexdigest()}")
    return out


def _input_text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return _tensor_text(value)
    return (
        f"{type(value).__qualname__} {value!r}"
        if isinstance(value, (int, float, bool, str, type(None)))
        else type(value).__qualname__
    )


_PLAIN = (int, float, bool, str, type(None))


def _module_text(module: nn.Module) -> list[str]:
    """Each submodule's name, class, training flag and plain attributes (`in_features`, `eps`, ...): what its code
    reads besides tensors. Not `repr(module)`, whose `extra_repr` may read a managed parameter (`nn.Linear`'s
    `self.bias`), which gathers it: a collective, here before the ranks agreed to compile."""
    return [
        f"module {name} {type(m).__module__}.{type(m).__qualname__} {m.training} "
        + repr(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, _PLAIN)))
        for name, m in module.named_modules()
    ]


def cache_key(module: nn.Module, places: Places, args: tuple, kwargs: dict, config: CompileConfig) -> str:
    """The digest naming the saved compile of `module(*args, **kwargs)` on this rank."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    parts = [
        f"fsdp2_compile {importlib.metadata.version('fsdp2_compile')} torch {torch.__version__} python {sys.version}",
        f"world {world} rank {rank} grad {torch.is_grad_enabled()}",
        f"config {dataclasses.replace(config, cache_dir=None)!r}",
        *_module_text(module),
        *(f"param {n} {_tensor_text(p)}" for n, p in module.named_parameters()),
        *(f"buffer {n} {_tensor_text(b)}" for n, b in module.named_buffers()),
        *_code_text(module),
        *(f"spec {spec!r}" for spec in _specs(places)),
        *(f"input {_input_text(v)}" for v in tree_leaves((args, kwargs))),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _read(path: str) -> Any:
    """The compiled function saved at `path`; None if there is none, or (with a warning) if it cannot be used."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
        if not data.startswith(MAGIC):
            raise ValueError("not a fsdp2_compile cache file")
        digest, payload = data[len(MAGIC) : len(MAGIC) + 64], data[len(MAGIC) + 65 :]
        if hashlib.sha256(payload).hexdigest().encode() != digest:
            raise ValueError("checksum mismatch: the file is cut short or altered")
        return aot_function_from_bytes(payload)
    except Exception as e:
        _EVENTS.append(("unreadable", path))
        log.warning(
            "fsdp2_compile: compile cache file %s cannot be used (%s: %s); compiling again and replacing it",
            path,
            type(e).__name__,
            (str(e).splitlines() or [""])[0],
        )
        return None


def _write(path: str, payload: bytes) -> None:
    """`payload` at `path`, atomically (a reader sees the old file or the whole new one), with its checksum."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# The key is a digest of what the saved graphs depend on: this package's, torch's and Python's versions, the world
# size and rank, the `CompileConfig` (less `cache_dir`), the module's structure, parameters and buffers (names,
# shapes, dtypes, meshes, placements), the code of its classes, every managed parameter's `ParamSpec` (process-group
# names, mixed precision, resharding, gradient sync, ...) and the call's inputs. A hit needs every rank to hit;
# otherwise every rank compiles and replaces its file (so does every rank when one keeps snapshots for a dump:
# a hit compiles nothing to record). A file that cannot be used (cut short, altered, from an incompatible torch)
# is named in a warning and compiled again; a module that cannot be compiled ahead of time (a graph break) is
# compiled as usual, with a warning, and nothing is saved.
#
# What torch saves is guarded on the inputs and global state only (guards on the module would pickle its generated
# classes); the module is in the key instead, and each call checks that the managed parameters' specs and the
# submodules' training flags are still the traced ones, else the module runs through its ordinary `torch.compile`
# (which compiles as usual). Other changes to the module after its first call (hooks added, attributes its forward
# reads) are not seen. A saved backward reduces as the forward's gradient-sync flags said: a backward run after they
# changed raises.
class WarmStart:
    """The calls of one compiled module with `cache_dir`: the first loads or compiles (and saves) `fn(module, *args,
    **kwargs)` ahead of time; later calls run that while the inputs pass its guards and the specs and training
    flags are the traced ones, else `jit` (the module's ordinary `torch.compile`)."""

    def __init__(
        self,
        module: nn.Module,
        fn: Callable,
        backend: Callable,
        config: CompileConfig,
        dynamic: bool | None,
        jit: Callable,
    ):
        self.module, self.fn, self.backend, self.jit = module, fn, backend, jit
        self.config, self.dynamic = config, dynamic
        self.compiled: Any = None
        self.specs: tuple | None = None
        self.modes: tuple | None = None
        self.tried = False

    def __call__(self, places: Places, *args: Any, **kwargs: Any) -> Any:
        if not self.tried:
            self.tried = True
            self._load_or_compile(places, args, kwargs)
        if self.compiled is not None and _specs(places) == self.specs and _modes(self.module) == self.modes:
            if self.compiled.guard_check(self.module, *args, **kwargs):
                out = self.compiled(self.module, *args, **kwargs)
                self._check_sync_at_backward(out, places)
                return out
        return self.jit(*args, **kwargs)

    def _load_or_compile(self, places: Places, args: tuple, kwargs: dict) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        key = cache_key(self.module, places, args, kwargs, self.config)
        path = os.path.join(os.path.abspath(self.config.cache_dir), f"{key[:40]}.rank{rank}.bin")
        dumping = self.config.keep_snapshots or dump_requested()  # a hit compiles nothing to dump: all compile
        loaded = None if dumping else _read(path)
        specs, self.modes = _specs(places), _modes(self.module)
        if first_call.start(places, self.config, loaded=loaded is not None):
            _EVENTS.append(("hit", path))
            log.info("fsdp2_compile: loaded the compiled module from %s", path)
            self.compiled, self.specs = loaded, specs
            return
        _EVENTS.append(("miss", path))
        try:
            with compiling_ahead_of_time():
                compiled = aot_compile_function(
                    self.fn, (self.module, *args), kwargs, self.backend, input_guards_only, self.dynamic
                )
        except Exception as e:  # a graph break (one graph is needed), ...: the ordinary compile, nothing saved
            _EVENTS.append(("uncompiled", path))
            log.warning(
                "fsdp2_compile: CompileConfig.cache_dir: the module cannot be compiled ahead of time (%s: %s); it is "
                "compiled as usual and nothing is saved",
                type(e).__name__,
                (str(e).splitlines() or [""])[0],
            )
            return
        self.compiled, self.specs = compiled, specs
        try:
            _write(path, aot_function_to_bytes(compiled))
            _EVENTS.append(("stored", path))
        except Exception as e:  # an unpicklable graph constant, a full disk: the compile is still used
            _EVENTS.append(("unstored", path))
            log.warning(
                "fsdp2_compile: could not store the compiled module in the compile cache at %s (%s: %s)",
                path,
                type(e).__name__,
                (str(e).splitlines() or [""])[0],
            )

    def _check_sync_at_backward(self, out: Any, places: Places) -> None:
        """The saved backward reduces as the flags were at this forward: one run after they changed raises
        before it runs (the ordinary compile keeps a variant per setting, `unsynced_backward.py`)."""
        flags = _sync_flags(places)
        nodes = {id(t.grad_fn): t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn}

        def check(_grad_outputs: Any) -> None:
            if _sync_flags(places) != flags:
                raise RuntimeError(
                    "fsdp2_compile: set_requires_gradient_sync / set_requires_all_reduce changed between a forward "
                    "and its backward of a module compiled with CompileConfig.cache_dir, whose saved backward "
                    "reduces as the forward's flags said; set them before the forward, or leave cache_dir unset"
                )

        for node in nodes.values():
            node.register_prehook(check)
