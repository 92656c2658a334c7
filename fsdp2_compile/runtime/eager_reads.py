"""One gather per parameter per eager forward of its group, as in FSDP2.

A parameter read twice in one forward (an embedding tied to the output head) is gathered once by FSDP2, so
autograd sums the two uses' gradients and backward reduces the sum once. Sharded modules run *without*
compilation gather on every attribute read; while a group's forward runs, the first read's gathered tensor is
kept here and returned to the later reads, so the gradients are summed before the one reduction, bitwise as in
`fully_shard`. (Compiled graphs fold repeated reads themselves: `graph.fold_repeated_unshards`.) Dropped when
the group's forward ends, so nothing stale outlives it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from fsdp2_compile.runtime.forward_hooks import add_eager_scope

__all__ = ["read_once", "read_once_in_eager_forward"]

_READS: dict[str, dict[int, torch.Tensor]] = {}
"""By bucket, while a forward of that group runs: id(sharded parameter) -> what its first read returned."""
_DEPTH: dict[str, int] = {}


def read_once(bucket: str, param: nn.Parameter, gather: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`gather()`, or what it returned for `param` earlier in the running forward of group `bucket`."""
    reads = _READS.get(bucket)
    if reads is None:
        return gather()
    if id(param) not in reads:
        reads[id(param)] = gather()
    return reads[id(param)]


@contextlib.contextmanager
def _read_scope(bucket: str) -> Iterator[None]:
    _DEPTH[bucket] = _DEPTH.get(bucket, 0) + 1
    _READS.setdefault(bucket, {})
    try:
        yield
    finally:
        _DEPTH[bucket] -= 1
        if not _DEPTH[bucket]:
            del _DEPTH[bucket], _READS[bucket]


def read_once_in_eager_forward(module: nn.Module, bucket: str) -> None:
    """While `module`'s eager forward runs, parameters of group `bucket` are gathered at most once each."""
    add_eager_scope(module, functools.partial(_read_scope, bucket))
