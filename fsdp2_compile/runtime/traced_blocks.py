"""Identical blocks traced once: `shard` makes the outermost blocks' forward a nested compile region while the
fsdp2 backend traces it (Dynamo traces one block and stamps out the others as `invoke_subgraph` calls); the
compiler then gathers their parameters outside the calls (`compiler/block_gathers.py`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MAX_TRACES", "TRACES_BLOCKS_ONCE", "traced_once"]

MAX_TRACES = 1024
"""Distinct traces of one block class Dynamo may keep before it raises: blocks that differ in shapes or settings,
and every block once parameters are kept after backward (`set_reshard_after_backward(False)`: each block reads
its own kept tensors by key, so no trace serves another block)."""


def traced_once(forward: Callable) -> Callable:
    """`forward`, as a nested compile region while the fsdp2 backend compiles it. Other backends (inductor,
    aot_eager, eager) trace it inline: torch 2.13 cannot run a nested region whose inputs are DTensors
    ("'FakeTensor' object has no attribute 'to_local'"), which only the fsdp2 backend works around."""
    region = torch.compiler.nested_compile_region(forward, max_reuse_entries=MAX_TRACES)

    @functools.wraps(forward)
    def forward_traced_once(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and _fsdp2_backend_tracing():
            return region(*args, **kwargs)
        return forward(*args, **kwargs)

    return forward_traced_once


TRACES_BLOCKS_ONCE = "fsdp2_traces_blocks_once"
"""The attribute that marks the fsdp2 backend function (`api.fsdp2_backend`)."""
_WARNED: set[str] = set()


@torch.compiler.assume_constant_result
def _fsdp2_backend_tracing() -> bool:
    """Whether blocks are traced once: the backend Dynamo traces for is fsdp2's (whichever compiler it hands the
    graph to: Inductor's handling of a block's saved inputs is worked around in `block_gathers.py`); run (not
    traced) by Dynamo, its result a constant. A sharded module compiled with another backend gets a warning, once
    per backend."""
    from fsdp2_compile._torch_private import tracing_backend  # AOTAutograd's imports wait for a compile

    backend = tracing_backend()
    fn = getattr(backend, "func", backend)  # make_backend's functools.partial
    if getattr(fn, TRACES_BLOCKS_ONCE, False):
        return True
    if backend is None:
        return False
    name = getattr(fn, "__name__", repr(fn))
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"fsdp2_compile: a sharded module compiled with backend {name!r}: its fsdp2::unshard ops run as they are "
            "(each parameter gathered alone, no bucketing, prefetch or overlap) and its blocks are traced one by "
            'one; compile with fsdp2_compile.shard_compile(model) or torch.compile(model, backend="fsdp2") for '
            "the compiler's passes (Inductor: shard_compile(model, "
            'compile_config=CompileConfig(compiler="inductor")))',
            stacklevel=2,
        )
    return False
