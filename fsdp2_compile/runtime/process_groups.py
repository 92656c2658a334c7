"""The process groups FSDP's own collectives run on: on gloo, a twin of each mesh group with one worker thread;
the smaller groups `reshard_after_forward=int` gathers from in backward (`resolve_reshard`).

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

import warnings
from datetime import timedelta

import torch.distributed as dist

from fsdp2_compile._torch_private import group_ranks, group_timeout, one_thread_gloo_backend, resolve_group
from fsdp2_compile.core.group_caches import dropped_with_groups

__all__ = ["fsdp_group", "resolve_reshard"]

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


_GROUPS: dict[tuple[str, int], str] = dropped_with_groups({})
"""(shard group name, size) -> the name of this rank's post-forward group."""


def resolve_reshard(value: object, shard_group_name: str, shard_size: int) -> tuple[bool, int, str]:
    """(reshard after forward, post-forward group size or 0, its group name) for `shard(reshard_after_forward=
    value)`, as `fully_shard` reads it: None is True; an int k must divide the shard group's size N; k == N is
    True, k == 1 is False (with FSDP2's warning). Creates this rank's group of k (collective over its members)."""
    if value is None or isinstance(value, bool):
        return value is not False, 0, ""
    if not isinstance(value, int):
        raise TypeError(
            f"shard(reshard_after_forward={value!r}): use True, False, or an int that divides the shard group's "
            f"size {shard_size} (reshard to a group that small after forward)"
        )
    if not 1 <= value <= shard_size or shard_size % value:
        raise ValueError(
            f"shard(reshard_after_forward={value}): as an int it is the size of the group parameters are resharded "
            f"to after forward and must divide the shard group's size {shard_size}; use one of "
            f"{[k for k in range(1, shard_size + 1) if shard_size % k == 0]}, or True / False"
        )
    if value == 1:
        warnings.warn(
            "shard(reshard_after_forward=1) reshards parameters to world size 1, i.e. keeps them gathered until "
            "backward: the same as reshard_after_forward=False (use that)",
            stacklevel=3,
        )
        return False, 0, ""
    if value == shard_size:
        return True, 0, ""
    return True, value, _post_forward_group(shard_group_name, value)


def _post_forward_group(shard_group_name: str, size: int) -> str:
    """This rank's group of `size` consecutive ranks of the shard group (FSDP2's `mesh.view(-1, size)` rows); on
    gloo with one worker thread, like the twins above."""
    key = (shard_group_name, size)
    if key not in _GROUPS:
        ranks = group_ranks(shard_group_name)
        start = ranks.index(dist.get_rank()) // size * size
        gloo = dist.get_backend(dist.group.WORLD) == "gloo"
        group = dist.new_group(
            ranks=ranks[start : start + size],
            backend=one_thread_gloo_backend() if gloo else None,
            timeout=timedelta(seconds=group_timeout(shard_group_name)),
            use_local_synchronization=True,
            group_desc=f"fsdp2_compile post-forward group of {size} in {shard_group_name}",
        )
        _GROUPS[key] = group.group_name
    return _GROUPS[key]
