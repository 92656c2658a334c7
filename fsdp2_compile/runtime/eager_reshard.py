"""`reshard_after_forward` for sharded modules run *without* compilation.

Compiled graphs get it from the partitioner. In eager mode, autograd would keep every gathered parameter that an
op saves for backward (a matmul saves its weight) until backward. So while a sharded module's forward runs, saved
tensors go through `saved_tensors_hooks`: a gathered parameter, or a view of one, is saved as a recipe (the
sharded parameter, and the view's size/stride/offset) and gathered again when backward unpacks it. Every rank
unpacks the same saved tensors in the same order, so the extra all-gathers match across ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from fsdp2_compile._torch_private import view_base
from fsdp2_compile.runtime.forward_hooks import add_eager_scope

__all__ = ["note_gathered", "reshard_in_eager_forward"]

_GATHERED = WeakTensorKeyDictionary()
"""Gathered parameters alive in an eager forward -> a function that gathers them again."""


def note_gathered(full: torch.Tensor, regather: Callable[[], torch.Tensor]) -> None:
    """Mark `full` (a gathered parameter) to be saved for backward as `regather` instead of itself (eager only)."""
    if torch.is_grad_enabled():
        _GATHERED[full] = regather


def _pack(t: torch.Tensor):
    base = view_base(t)
    regather = _GATHERED.get(t if base is None else base)
    if regather is None:
        return t
    return regather, t.size(), t.stride(), t.storage_offset()


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    regather, size, stride, offset = packed
    with torch.no_grad():
        return regather().as_strided(size, stride, offset)


def reshard_in_eager_forward(module: nn.Module) -> None:
    """Route the tensors `module`'s eager forward saves for backward through `_pack` / `_unpack`."""
    add_eager_scope(module, lambda: torch.autograd.graph.saved_tensors_hooks(_pack, _unpack))
