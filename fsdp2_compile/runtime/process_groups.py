"""The process groups FSDP's own collectives run on: on gloo, a twin of each mesh group with one worker thread;
the smaller groups `reshard_after_forward=int` gathers from in backward (`resolve_reshard`).
"""

from __future__ import annotations

import os
import secrets
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from fsdp2_compile._torch_private import (
    group_ranks,
    group_timeout,
    one_thread_gloo_backend,
    resolve_group,
    store_keys_under,
)
from fsdp2_compile.core.group_caches import dropped_with_groups

__all__ = ["attempt_token", "fsdp_group", "resolve_reshard", "serial_gloo_group"]

_TWINS: dict[str, str] = dropped_with_groups({})
"""Mesh group name -> the name of its one-thread gloo twin."""


# Why: `ProcessGroupGloo` runs queued collectives on two worker threads, so with all-gathers prefetched (started
# before the compute they overlap, as the scheduler emits them) two collectives of one group execute at once. On
# torch 2.13 that corrupts the heap: glibc aborts ("malloc(): unaligned tcache chunk detected") or a rank segfaults
# inside gloo's all-gather, within a few hundred steps of a small GPT (`benchmarks/soak.py`); with at most one
# collective in flight, or with one worker thread, it does not happen. One worker thread is also what the cost model
# assumes (one communication lane, collectives in issue order) and what NCCL does (one stream per group), and it
# still overlaps communication with compute: collectives run on that thread while the graph computes.
#
# The twin has the same ranks and timeout as the mesh group; it is created once per group (`new_group` with local
# synchronization: only its members take part, in the order `shard` is called, which every rank shares) and used
# only by the fsdp2 ops. DTensor's own collectives (`full_tensor`, `clip_grad_norm_`) keep the mesh group. Other
# backends (NCCL) use the mesh group as it is.
#
# Each twin publishes its gloo addresses in the store under a token its ranks draw afresh when they make it (one
# broadcast over the mesh group, `attempt_token`). Gloo's keys are otherwise a function of the group's name alone,
# which a restarted attempt reuses: under torchrun's `--max-restarts`, whose agent keeps the store of the attempt
# that died, a rank would read its dead peer's address (a refused connection, or a hang). The rank-consistency
# check keys its records with the same token.
def fsdp_group(group_name: str) -> str:
    """The name of the group FSDP collectives of the mesh group `group_name` run on."""
    if not group_name or dist.get_backend(resolve_group(group_name)) != "gloo":
        return group_name
    if group_name not in _TWINS:
        _warn_if_restarts_share_the_store()
        _TWINS[group_name] = serial_gloo_group(
            group_name, group_ranks(group_name), f"fsdp2_compile serial twin of {group_name}"
        )
    return _TWINS[group_name]


ELASTIC_RESTART_SETTINGS = (
    "for in-place restarts launch with `--rdzv-backend c10d` and the environment variable "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (each attempt gets a fresh store), or with --max-restarts 0 and let the "
    "scheduler relaunch the job (resuming from its checkpoint)"
)


def _warn_if_restarts_share_the_store() -> None:
    """Warn when torchrun may restart this gloo job in place (`--max-restarts` > 0) on the store of its agent, which
    outlives a failed attempt with its keys: gloo's `init_process_group` in the next attempt can read a dead rank's
    address and fail ("Connection refused") or hang until its timeout, before any code of ours runs."""
    if (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
        and dist.get_backend() == "gloo"
    ):
        warnings.warn(
            "fsdp2_compile: torchrun restarts this job in place (--max-restarts "
            f"{os.environ['TORCHELASTIC_MAX_RESTARTS']}) on its agent's store, which keeps the keys of an attempt "
            "that dies: the next attempt's init_process_group (gloo) may read a dead rank's address and fail with "
            "'Connection refused' or hang until its timeout, with fully_shard as with shard; "
            + ELASTIC_RESTART_SETTINGS,
            stacklevel=6,  # fc.shard's caller
        )


_TOKENS: dict[str, str] = dropped_with_groups({})
"""Name of a group made here -> the token its ranks drew when it was made."""


def _draw_token(group_name: str) -> str:
    """A random token, the same on every rank of the group `group_name` (a broadcast from its first rank): different
    in each attempt of a restarted job, so keys under it never meet an earlier attempt's."""
    token = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
    dist.broadcast(token, src=group_ranks(group_name)[0], group=resolve_group(group_name))
    return f"{token.item():x}"


def serial_gloo_group(parent_name: str, ranks: list[int], desc: str) -> str:
    """The name of a new group of `ranks` on gloo with one worker thread, with the parent group's timeout; every rank
    of the group `parent_name` calls it (the token its gloo keys go under is drawn over that group)."""
    token = _draw_token(parent_name)
    with store_keys_under(f"fsdp2_compile/{token}/"):
        group = dist.new_group(
            ranks=ranks,
            backend=one_thread_gloo_backend(),
            timeout=timedelta(seconds=group_timeout(parent_name)),
            use_local_synchronization=True,
            group_desc=desc,
        )
    _TOKENS[group.group_name] = token
    return group.group_name


def attempt_token(group_name: str) -> str:
    """What scopes store keys to this attempt of the job: the token the ranks of `group_name` drew when it was
    made (a twin or a post-forward group), else under torchrun the attempt's restart count ("r2"), else "" (a
    launch whose store does not outlive it)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return _TOKENS.get(group_name) or (f"r{restart}" if restart else "")


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
        members, desc = ranks[start : start + size], f"fsdp2_compile post-forward group of {size} in {shard_group_name}"
        if dist.get_backend(dist.group.WORLD) == "gloo":
            _GROUPS[key] = serial_gloo_group(shard_group_name, members, desc)
        else:
            timeout = timedelta(seconds=group_timeout(shard_group_name))
            group = dist.new_group(members, timeout=timeout, use_local_synchronization=True, group_desc=desc)
            _GROUPS[key] = group.group_name
    return _GROUPS[key]
