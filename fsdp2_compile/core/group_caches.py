"""Caches keyed by process-group names, emptied when the groups they were filled under are gone.

`destroy_process_group` destroys every group, and a new `init_process_group` hands the same names ("0", "1", ...)
to new groups, which such a cache would resolve to what it held for the old ones. Each cache registers here
(`dropped_with_groups`); `forget_destroyed_groups` empties them all when the default process group is not the one
they were filled under (`shard` calls it before anything is cached for a module).
"""

from __future__ import annotations

import weakref
from typing import TypeVar

import torch.distributed as dist

__all__ = ["dropped_with_groups", "forget_destroyed_groups"]

T = TypeVar("T")

_CACHES: list = []
_WORLD: list[weakref.ref] = []
"""The default process group the caches were filled under (a weak reference), or nothing."""


def dropped_with_groups(cache: T) -> T:
    """Register `cache` (a dict or set keyed by process-group names) to be emptied with its groups; returns it."""
    _CACHES.append(cache)
    return cache


def forget_destroyed_groups() -> None:
    """Empty every registered cache if the default process group is not the one they were filled under."""
    world = dist.group.WORLD
    if _WORLD and _WORLD[0]() is world:
        return
    for cache in _CACHES:
        cache.clear()
    _WORLD[:] = [weakref.ref(world)] if world is not None else []
