"""Warm restarts (`CompileConfig.cache_dir`): a module's first call is compiled through torch's ahead-of-time
compile and saved, one file per rank; a relaunch that finds the file of the same key on every rank loads it and
neither traces nor compiles (Dynamo, AOTAutograd, the partition and the passes all skipped). Whether every rank
loaded is agreed at the first call (`first_call.py`), where a rank without `cache_dir` among ranks with it is named.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import logging
import os
import pickle
import re
import sys
import tempfile
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2_compile._torch_private import (
    aot_compile_function,
    aot_compiled_sources,
    aot_function_from_bytes,
    aot_function_to_bytes,
    compile_settings_digest,
    maybe_mark_dynamic,
    torch_cache_dir,
)
from fsdp2_compile.compiler import first_call
from fsdp2_compile.compiler.graph_records import dump_requested
from fsdp2_compile.compiler.rank_consistency import compiled_as
from fsdp2_compile.config import AUTO, CompileConfig
from fsdp2_compile.runtime.param_state import ParamInfo, own_parameters
from fsdp2_compile.runtime.rank_agreement import agreed_in, restore_agreed
from fsdp2_compile.runtime.traced_blocks import compiling_ahead_of_time

__all__ = ["WarmStart", "cache_events", "cache_path", "input_guards_only"]

log = logging.getLogger("fsdp2_compile")

MAGIC = b"fsdp2-compile ahead-of-time 3\n"
_EVENTS: list[tuple[str, str]] = []
_SAVED_HERE: set[str] = set()
"""The files this process wrote: it compiles a module again rather than load its own (relaunches load them)."""


def cache_events() -> list[tuple[str, str]]:
    """(what, file) for each cache file this process looked for: "hit" (loaded, every rank loaded its own),
    "miss" (compiled), "stored", "unreadable" (warned, compiled again), "stale" (code it traced has changed since:
    compiled again), "unstored" (warned), "uncompiled" (the ahead-of-time compile raised: the module's
    ordinary compile runs), "dropped" (deleted by the process that saved it: gradient sync changed between
    a forward and its backward, which a saved backward cannot follow)."""
    return list(_EVENTS)


CACHE_DIR_VARIABLE = "FSDP2_COMPILE_CACHE_DIR"
"""The environment variable naming where `CompileConfig(cache_dir="auto")` saves."""


def cache_path(cache_dir: str | os.PathLike) -> str:
    """The directory `CompileConfig.cache_dir` names: "auto" is $FSDP2_COMPILE_CACHE_DIR, else `fsdp2_compile/`
    under the directory of torch's compile caches (Inductor's FX graph cache's: $TORCHINDUCTOR_CACHE_DIR, else
    `torchinductor_<user>` in the temporary directory)."""
    if cache_dir == AUTO:
        return os.path.abspath(os.environ.get(CACHE_DIR_VARIABLE) or os.path.join(torch_cache_dir(), "fsdp2_compile"))
    return os.path.abspath(cache_dir)


State = tuple[str, str, tuple[str, ...]]
"""What traced code read besides its inputs, as ("module", submodule name, (attribute,)) or ("global", Python
module name, (attribute, ...)): Dynamo guards it, but a saved compile cannot hold those guards."""


def input_guards_only(entries: Sequence[Any], read: set[State] | None = None) -> list[bool]:
    """The Dynamo guards saved: global state, symbolic shapes and the call's tensor inputs. Those on the module and
    on Python globals cannot be saved (they would pickle the module or a Python module): what they read, module
    attributes and hook dicts, module-level variables and dicts, is added to `read`, for `WarmStart` to compare at
    each call."""
    if read is not None:
        for e in entries:
            if not e.is_global and (match := _MODULE_ATTRIBUTE.fullmatch(e.name)):
                read.add(("module", ".".join(re.findall(r"\['([^']+)'\]", match[1])), (match[2],)))
            elif e.is_global and (match := _GLOBAL.fullmatch(e.name)):
                read.add(("global", match[1].replace("_dot_", "."), tuple(match[2].split(".")[1:])))
    return [
        e.guard_type in ("GLOBAL_STATE", "SHAPE_ENV")
        or (e.guard_type == "TENSOR_MATCH" and not e.is_global and not e.name.startswith("module"))
        for e in entries
    ]


_MODULE_ATTRIBUTE = re.compile(r"module((?:\._modules\['[^']+'\])*)\.(\w+)")
"""A Dynamo guard's source that reads an attribute of the module or a submodule (`module._modules['blocks']
._modules['0'].n_head`)."""
_GLOBAL = re.compile(r"G\['__import_(\w+)'\]((?:\.\w+)+)")
"""A Dynamo guard's source that reads a variable of a Python module, or an attribute of one
(`G['__import___main__'].FLAG`, `G['__import_torch_dot_nn_dot_modules_dot_module']._global_forward_hooks`)."""
_ABSENT = object()


def _state_reader(module: nn.Module, state: Sequence[State]) -> Callable[[], list[Any]]:
    """What the traced code read of `state`, as a function: each value, a dict's keys as Dynamo guards them (their
    number where they are not plain values)."""
    roots = [
        (module.get_submodule(name) if scope == "module" else sys.modules.get(name, _ABSENT), attributes)
        for scope, name, attributes in state
    ]

    def read() -> list[Any]:
        values = []
        for value, attributes in roots:
            for attribute in attributes:
                value = getattr(value, attribute, _ABSENT)
            if isinstance(value, dict):
                value = tuple(value) if _plain(list(value)) else len(value)
            values.append(value)
        return values

    return read


def _changed_sources(compiled: Any) -> list[str]:
    """The modules whose code Dynamo traced into `compiled` and whose source differs now (or cannot be read)."""
    changed = []
    for name, content in aot_compiled_sources(compiled):
        try:
            now = inspect.getsource(sys.modules.get(name) or importlib.import_module(name))
        except Exception:
            now = None
        if now != content:
            changed.append(name)
    return changed


def tree_leaves(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in tree_leaves(v)]
    if isinstance(value, dict):
        return [leaf for k in sorted(value, key=repr) for leaf in tree_leaves(value[k])]
    return [value]


Places = Sequence[tuple[nn.Module, str, ParamInfo]]


def _specs(places: Places) -> tuple:
    """What the traced graph baked in of each managed parameter: its `ParamSpec`, whether it requires grad and
    whether it is still a DTensor (the ordinary compile names one replaced after `shard`)."""
    params = [own_parameters(mod)[name] for mod, name, _ in places]
    return tuple(
        (info.spec(), p.requires_grad, isinstance(p, DTensor)) for (_, _, info), p in zip(places, params, strict=True)
    )


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


def _plain(value: Any) -> bool:
    """A value whose repr is its content: a number, string, None, or a tuple, list or dict of them."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN)


def _module_text(module: nn.Module) -> list[str]:
    """Each submodule's name, class, training flag and plain attributes (`in_features`, `eps`, `normalized_shape`,
    ...): what its code reads besides tensors. Not `repr(module)`, whose `extra_repr` may read a managed parameter
    (`nn.Linear`'s `self.bias`), which gathers it: a collective, here before the ranks agreed to compile."""
    return [
        f"module {name} {type(m).__module__}.{type(m).__qualname__} {m.training} "
        + repr(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and _plain(v)))
        for name, m in module.named_modules()
    ]


def cache_key(module: nn.Module, places: Places, args: tuple, kwargs: dict, config: CompileConfig) -> str:
    """The digest naming the saved compile of `module(*args, **kwargs)` on this rank."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    parts = [
        f"fsdp2_compile {importlib.metadata.version('fsdp2_compile')} torch {torch.__version__} python {sys.version}",
        f"torch compile settings {compile_settings_digest()}",
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


def _read(path: str) -> tuple[Any, list[tuple[str, str, tuple, Any]], list] | None:
    """The compiled function saved at `path`, the state it read besides its inputs and the records the ranks
    agreed on as it compiled; None if there is none, or (with a warning) if it cannot be used, or (logged) if code it
    traced has changed since."""
    if path in _SAVED_HERE or not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
        if not data.startswith(MAGIC):
            raise ValueError("not a fsdp2_compile cache file of this version")
        digest, payload = data[len(MAGIC) : len(MAGIC) + 64], data[len(MAGIC) + 65 :]
        if hashlib.sha256(payload).hexdigest().encode() != digest:
            raise ValueError("checksum mismatch: the file is cut short or altered")
        state, agreed, compiled = pickle.loads(payload)
        compiled = aot_function_from_bytes(compiled)
    except Exception as e:
        _EVENTS.append(("unreadable", path))
        log.warning(
            "fsdp2_compile: compile cache file %s cannot be used (%s: %s); compiling again and replacing it",
            path,
            type(e).__name__,
            (str(e).splitlines() or [""])[0],
        )
        return None
    if changed := _changed_sources(compiled):
        _EVENTS.append(("stale", path))
        log.info("fsdp2_compile: the code of %s changed since %s was saved; compiling again", ", ".join(changed), path)
        return None
    return compiled, state, agreed


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


# The key is a digest of what the saved graphs depend on: this package's, torch's and Python's versions, the
# settings of Dynamo, AOTAutograd and Inductor, the world size and rank, the `CompileConfig` (less `cache_dir`),
# the module's structure, parameters and buffers (names, shapes, dtypes, meshes, placements), its submodules'
# plain attributes, the code of its classes, every managed parameter's `ParamSpec` (process-group names, mixed
# precision, resharding, gradient sync, ...) and the call's inputs. A hit needs every rank to hit; otherwise every
# rank compiles and replaces its file (so does every rank when one keeps snapshots for a dump: a hit compiles
# nothing to record). A file that cannot be used (cut short, altered, from an incompatible torch) is named in a
# warning and compiled again, as is one whose traced code (every module Dynamo traced through, by source) changed
# since; a module that cannot be compiled ahead of time (a graph break) is compiled as usual, and nothing is saved.
#
# What torch saves is guarded on the inputs and global state only (guards on the module would pickle it). The
# module's attributes and hook dicts that Dynamo guarded are saved with it instead, and each call checks that they
# and the managed parameters' specs are as traced, else the module runs through its ordinary `torch.compile`
# (which compiles as usual, guarded by Dynamo). A saved backward reduces as the forward's gradient-sync flags said;
# where it was compiled, a backward run after they changed runs a variant (`backend.py`), and a loaded one raises
# (`_check_sync_at_backward`). A process loads no file it saved. The saved graphs are watched as compiled ones are
# (`saved_graphs.py`).
class WarmStart:
    """The calls of one compiled module with `cache_dir`: the first loads or compiles (and saves) `fn(module, *args,
    **kwargs)` ahead of time; later calls run that while the inputs pass its guards and the module's guarded state
    and parameter specs are the traced ones, else `jit` (the module's ordinary `torch.compile`)."""

    def __init__(
        self,
        module: nn.Module,
        fn: Callable,
        backend: Callable,
        config: CompileConfig,
        dynamic: bool | None,
        jit: Callable,
    ):
        # a globals dict of its own, emptied when the module dies: what Dynamo installs there (the compiled function)
        # goes with the module, though Dynamo's guard manager, kept alive by its finalizers, holds the dict
        fn = types.FunctionType(fn.__code__, dict(fn.__globals__), fn.__name__, fn.__defaults__, fn.__closure__)
        weakref.finalize(module, fn.__globals__.clear)
        self.module, self.fn, self.backend, self.jit = module, fn, backend, jit
        self.config, self.dynamic = config, dynamic
        self.compiled: Any = None
        self.specs: tuple | None = None
        self.sizes: list[tuple[int, ...] | None] = []
        self.read_state: Callable[[], list[Any]] | None = None
        self.state: list[Any] | None = None
        self.tried = self.loaded = self.dropped = False
        self.path = ""
        self.frame = object()
        """What its compiles are paired by across ranks (`rank_consistency.compiled_as`) once it has a saved one."""

    def __call__(self, places: Places, *args: Any, **kwargs: Any) -> Any:
        if not self.tried:
            self.tried = True
            self._load_or_compile(places, args, kwargs)
        if self.compiled is not None and _specs(places) == self.specs and self.read_state() == self.state:
            if self.compiled.guard_check(self.module, *args, **kwargs):
                out = self.compiled(self.module, *args, **kwargs)
                if self.loaded or not self.dropped:
                    self._check_sync_at_backward(out, places)
                return out
        if self.specs is None:  # no saved compile (a graph break): Dynamo's frames, as without cache_dir
            return self.jit(*args, **kwargs)
        if self.dynamic is None:
            self._mark_changed_sizes((args, kwargs))
        with compiled_as(self.frame):  # a recompile of the saved one (a new shape on one rank waits for no other)
            return self.jit(*args, **kwargs)

    def _mark_changed_sizes(self, inputs: Any) -> None:
        """The input sizes that differ from the saved compile's, marked dynamic: Dynamo's first compile after it
        is dynamic in them, as its recompile of the saved one would be (`dynamic=None`: static, then dynamic in
        the sizes that changed)."""
        for now, then in zip(tree_leaves(inputs), self.sizes):
            if isinstance(now, torch.Tensor) and then is not None and now.dim() == len(then):
                for dim in (d for d, (a, b) in enumerate(zip(now.shape, then)) if a != b):
                    maybe_mark_dynamic(now, dim)

    def _use(self, compiled: Any, places: Places, state: Sequence[tuple[str, str, tuple, Any]], inputs: Any) -> None:
        """Run `compiled` (for `inputs`' sizes) while the parameters' specs are as now and what it read besides
        its inputs (`state`: scope, name, attributes, value traced) is as traced."""
        self.compiled, self.specs = compiled, _specs(places)
        self.sizes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in tree_leaves(inputs)]
        self.read_state = _state_reader(self.module, [read for *read, _ in state])
        self.state = [value for *_, value in state]

    def _load_or_compile(self, places: Places, args: tuple, kwargs: dict) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        key = cache_key(self.module, places, args, kwargs, self.config)
        path = self.path = os.path.join(cache_path(self.config.cache_dir), f"{key[:40]}.rank{rank}.bin")
        dumping = self.config.keep_snapshots or dump_requested()  # a hit compiles nothing to dump: all compile
        loaded = None if dumping else _read(path)
        if first_call.start(places, self.config, loaded=loaded is not None):
            _EVENTS.append(("hit", path))
            self.loaded = True
            log.info("fsdp2_compile: loaded the compiled module from %s", path)
            self._use(loaded[0], places, loaded[1], (args, kwargs))
            restore_agreed(self.frame, loaded[2])
            return
        _EVENTS.append(("miss", path))
        state: set[State] = set()
        try:
            with compiling_ahead_of_time(self.config), compiled_as(self.frame):
                compiled = aot_compile_function(
                    self.fn,
                    (self.module, *args),
                    kwargs,
                    self.backend,
                    functools.partial(input_guards_only, read=state),
                    self.dynamic,
                )
        except Exception as e:  # a graph break (one graph is needed), ...: the ordinary compile, nothing saved
            _EVENTS.append(("uncompiled", path))
            log.log(
                logging.INFO if self.config.cache_dir == AUTO else logging.WARNING,
                "fsdp2_compile: CompileConfig.cache_dir: the module cannot be compiled ahead of time (%s: %s); it is "
                "compiled as usual and nothing is saved",
                type(e).__name__,
                (str(e).splitlines() or [""])[0],
            )
            return
        names = sorted(state)
        traced = [(*name, value) for name, value in zip(names, _state_reader(self.module, names)()) if _plain(value)]
        self._use(compiled, places, traced, (args, kwargs))
        try:
            _write(path, pickle.dumps((traced, agreed_in(self.frame), aot_function_to_bytes(compiled))))
            _SAVED_HERE.add(path)
            _EVENTS.append(("stored", path))
        except Exception as e:  # an unpicklable graph constant, a full disk: the compile is still used
            _EVENTS.append(("unstored", path))
            log.warning(
                "fsdp2_compile: could not store the compiled module in the compile cache at %s (%s: %s)",
                path,
                type(e).__name__,
                (str(e).splitlines() or [""])[0],
            )

    def _drop(self, reason: str) -> None:
        """Delete the file this process saved, and run the ordinary compile from the next call: what it saved does
        not serve this module (`reason`)."""
        self.dropped, self.compiled = True, None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return
        _EVENTS.append(("dropped", self.path))
        log.info("fsdp2_compile: deleted %s (%s): a relaunch compiles as usual", self.path, reason)

    def _check_sync_at_backward(self, out: Any, places: Places) -> None:
        """The saved backward reduces as the flags were at this forward. Compiled in this process, a run after they
        changed runs a variant (`unsynced_backward.py`), the file is deleted, so that a relaunch compiles as usual,
        and the module runs its ordinary compile from then on; loaded, it raises before it runs."""
        flags = _sync_flags(places)
        nodes = {id(t.grad_fn): t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn}

        def check(_grad_outputs: Any) -> None:
            if _sync_flags(places) == flags:
                return
            if not self.loaded:  # a variant runs here (backend.py)
                self._drop("gradient sync changed between a forward and its backward")
                return
            raise RuntimeError(
                "fsdp2_compile: set_requires_gradient_sync / set_requires_all_reduce changed between a forward "
                f"and its backward of a module whose compile was loaded from {self.path}, whose saved backward "
                "reduces as the forward's flags said; set them before the forward, or compile with "
                "CompileConfig(cache_dir=None)"
            )

        for node in nodes.values():
            node.register_prehook(check)
