"""The process groups FSDP's own collectives run on: on gloo, a twin of each mesh group with one worker thread.

Why: `ProcessGroupGloo` runs queued collectives on two worker threads, so with all-gathers prefetched (started
before the compute they overlap, as the scheduler emits them) two collectives of one group execute at once. On
torch 2.13 that corrupts the heap: glibc aborts ("malloc(): unaligned tcache chunk detected") or a rank segfaults
inside gloo's all-gather, within a few hundred steps of a small GPT (`benchmarks/soak.py`); with at most one
collective in flight, or with one worker thread, it does not happen. One worker thread is also what the cost model
assumes (one communication lane, collectives in issue order) and what NCCL does (one stream per group), and it
still overlaps communication with compute: collectives run on that thread while the graph computes.

The twin has the same ranks and timeout as the mesh group; it is created once per group (`new_group` with local
synchronization: only its members take part, in the order `shard` is called, which every rank shares) and used
only by the fsdp2 ops. DTensor's own collectives (`full_tensor`, `clip_grad_norm_`) keep the mesh group. Other
backends (NCCL) use the mesh group as it is.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from ._torch_private import group_ranks, group_timeout, one_thread_gloo_backend, resolve_group

__all__ = ["dropped_with_groups", "forget_destroyed_groups", "fsdp_group"]

T = TypeVar("T")

_CACHES: list = []
_WORLD: list[weakref.ref] = []
"""The default process group the caches were filled under (a weak reference), or nothing."""


def dropped_with_groups(cache: T) -> T:
    """Register `cache` (a dict or set keyed by process-group names) to be emptied when the default process group
    it was filled under is destroyed (`forget_destroyed_groups`); returns it."""
    _CACHES.append(cache)
    return cache


def forget_destroyed_groups() -> None:
    """Empty every cache registered with `dropped_with_groups` if the default process group is not the one they
    were filled under: `destroy_process_group` destroys every group, and a new `init_process_group` hands the same
    names ("0", "1", ...) to new groups, which the caches would resolve to what they held for the old ones. Called
    by `shard`, before anything is cached for a module."""
    world = dist.group.WORLD
    if _WORLD and _WORLD[0]() is world:
        return
    for cache in _CACHES:
        cache.clear()
    _WORLD[:] = [weakref.ref(world)] if world is not None else []


_TWINS: dict[str, str] = dropped_with_groups({})
"""Mesh group name -> the name of its one-thread gloo twin."""


def fsdp_group(group_name: str) -> str:
    """The name of the group FSDP collectives of the mesh group `group_name` run on."""
    if not group_name or dist.get_backend(resolve_group(group_name)) != "gloo":
        return group_name
    if group_name not in _TWINS:
        twin = dist.new_group(
            ranks=group_ranks(group_name),
            backend=one_thread_gloo_backend(),
            timeout=timedelta(seconds=group_timeout(group_name)),
            use_local_synchronization=True,
            group_desc=f"fsdp2_compile serial twin of {group_name}",
        )
        _TWINS[group_name] = twin.group_name
    return _TWINS[group_name]

