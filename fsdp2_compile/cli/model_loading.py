"""What `fsdp2-compile` runs a model from: TARGET import (`module:factory` or `path/to/file.py:factory`), the
checked factory call, and the fake process group both subcommands run under."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported on use: `fsdp2-compile --help` does not need it
    import torch
    from torch import nn

__all__ = [
    "SEQ_LEN_NAMES",
    "RunError",
    "UsageError",
    "call_factory",
    "default_loss",
    "fake_group",
    "load_target",
    "sized_call",
]


class UsageError(Exception):
    """Bad command line or TARGET: exit code 2."""


class RunError(Exception):
    """The factory or the run failed: exit code 1."""


def load_target(spec: str) -> Callable:
    """The factory named by `module:factory` or `path/to/file.py:factory`."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"TARGET {spec!r} is not of the form module:factory or path/to/file.py:factory")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = os.path.abspath(module_name)
            if not os.path.isfile(path):
                raise UsageError(f"TARGET {spec!r}: no such file {module_name!r}")
            sys.path.insert(0, os.path.dirname(path))  # so the file's sibling imports work
            name = "_fsdp2_target_" + os.path.splitext(os.path.basename(path))[0]
            loader_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            loader_spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except Exception as e:  # ImportError, SyntaxError, or whatever the module raised at import
        raise UsageError(f"TARGET {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"TARGET {spec!r}: {module_name!r} has no callable {attr!r}")
    return factory


def default_loss(output) -> torch.Tensor:
    """Sum of the first floating-point tensor in `output` (tensors, tuples, lists, dicts)."""
    import torch

    stack = [output]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.float().sum()
        if isinstance(x, (list, tuple)):
            stack[:0] = list(x)
        elif isinstance(x, dict):
            stack[:0] = list(x.values())
    raise RunError("the model's output has no floating-point tensor for the default loss; return a loss_fn")


def call_factory(factory: Callable, **kwargs) -> tuple[nn.Module, tuple, Callable]:
    """`factory(**kwargs)` checked: (model, args, loss_fn) with the default loss filled in."""
    import torch
    from torch import nn

    name = getattr(factory, "__name__", repr(factory))
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        params = []
    needed = [
        p.name
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in kwargs
    ]
    if needed:
        raise RunError(
            f"factory {name}() needs {', '.join(n + '=' for n in needed)}, and the command calls it with "
            f"{', '.join(f'{k}={v!r}' for k, v in kwargs.items()) or 'no arguments'} (--seq-len and --local-batch "
            f"pass seq_len= and batch=): give them defaults, or name a factory that fixes them, e.g. "
            f"def make(): return {name}({needed[0]}=...)"
        )
    try:
        result = factory(**kwargs)
    except Exception as e:
        raise RunError(f"factory {name}() raised {type(e).__name__}: {e}") from e
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise RunError(
            f"factory {name}() returned {type(result).__name__}; expected (model, args) or (model, args, loss_fn)"
        )
    model, args, *rest = result
    loss_fn = rest[0] if rest else default_loss
    if not isinstance(model, nn.Module):
        raise RunError(f"factory {name}() returned a {type(model).__name__} as the model; expected an nn.Module")
    if next(model.parameters(), None) is None:
        raise RunError(
            f"factory {name}() returned a {type(model).__name__} without parameters: there is nothing to shard "
            "(return the model whose parameters are to be sharded)"
        )
    if isinstance(args, torch.Tensor):
        args = (args,)
    if not isinstance(args, (tuple, list)):
        raise RunError(f"factory {name}() returned a {type(args).__name__} as args; expected a tuple of inputs")
    if not callable(loss_fn):
        raise RunError(f"factory {name}() returned a non-callable loss_fn ({type(loss_fn).__name__})")
    return model, tuple(args), loss_fn


SEQ_LEN_NAMES = ("seq_len", "max_seq_len", "seq")
"""The factory arguments `--seq-len` sets, the first one the factory takes."""


def sized_call(factory: Callable, seq_len: int | None, batch: int | None = None) -> Callable:
    """`call_factory`, with `--seq-len` passed as the sequence-length argument `factory` takes (SEQ_LEN_NAMES) and
    `--local-batch` as its batch=; UsageError when it takes no such argument."""
    if seq_len is None and batch is None:
        return call_factory
    name = getattr(factory, "__name__", repr(factory))
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    given = {}
    if seq_len is not None:
        arg = next((n for n in SEQ_LEN_NAMES if n in params), None)
        if arg is None:
            raise UsageError(
                f"--seq-len {seq_len}: factory {name}() takes none of {', '.join(n + '=' for n in SEQ_LEN_NAMES)}; "
                "give it one of those arguments (the sequence length of the inputs it builds) or leave --seq-len out"
            )
        given[arg] = seq_len
    if batch is not None:
        if "batch" not in params:
            raise UsageError(
                f"--local-batch {batch}: factory {name}() takes no batch=; give it a batch= argument (the samples "
                "of the inputs it builds) or leave --local-batch out"
            )
        given["batch"] = batch
    return functools.partial(_call_with, given)


def _call_with(given: dict, factory: Callable, **kwargs) -> tuple[nn.Module, tuple, Callable]:
    return call_factory(factory, **{**given, **kwargs})


@contextmanager
def fake_group(world_size: int):
    """The fake default process group (rank 0 of `world_size`) for the duration of the block."""
    import torch

    from fsdp2_compile._torch_private import clear_dtensor_caches, fake_process_group

    if torch.distributed.is_initialized():
        raise RunError("a default process group is already initialised in this process")
    clear_dtensor_caches()
    fake_process_group(0, world_size)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
        clear_dtensor_caches()
