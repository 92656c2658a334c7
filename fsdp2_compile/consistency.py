"""Rank consistency: every rank must issue the same collectives in the same order, or the job hangs.

After compiling a graph, each rank publishes the sequence of its collectives (kind, dtype, bytes) in the process
group's store and reads every other rank's; any difference raises, on every rank, an error naming the ranks and
the first differing collective. A rank that never publishes (it failed to compile) makes the others raise after
`timeout_s` instead of hanging in the first collective.
"""

from __future__ import annotations

import hashlib
import itertools
from datetime import timedelta

import torch.distributed as dist
from torch import fx

from ._torch_private import default_store
from .report import collectives

__all__ = ["schedule_signature", "check_same_schedule"]

_counter = itertools.count()


def schedule_signature(gm: fx.GraphModule) -> str:
    """The collectives of `gm` in order, one `kind:dtype:bytes` per line."""
    return "\n".join(f"{c.kind}:{str(c.dtype).removeprefix('torch.')}:{c.nbytes}" for c in collectives(gm))


def check_same_schedule(gm: fx.GraphModule, kind: str, timeout_s: float = 120.0) -> None:
    """Raise on every rank if the ranks compiled different collective schedules for this graph."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    store = default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"fsdp2_compile/schedule/{next(_counter)}/{kind}"
    mine = schedule_signature(gm)
    store.set(f"{key}/{rank}", mine)
    keys = [f"{key}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as e:  # a timeout: some rank never published
        missing = [r for r in range(world) if not store.check([f"{key}/{r}"])]
        raise RuntimeError(
            f"fsdp2_compile: rank(s) {missing} did not publish their {kind} schedule within {timeout_s:.0f} s "
            "(they failed to compile or compiled different graphs); look at their errors"
        ) from e
    for r in range(world):
        theirs = store.get(f"{key}/{r}").decode()
        if theirs != mine:
            ours, other = mine.splitlines(), theirs.splitlines()
            i = next((i for i, (a, b) in enumerate(zip(ours, other)) if a != b), min(len(ours), len(other)))
            raise RuntimeError(
                f"fsdp2_compile: rank {rank} and rank {r} compiled different {kind} schedules "
                f"(sha256 {hashlib.sha256(mine.encode()).hexdigest()[:12]} vs {hashlib.sha256(theirs.encode()).hexdigest()[:12]}); "
                f"collective #{i}: {ours[i] if i < len(ours) else 'none'} here vs {other[i] if i < len(other) else 'none'} "
                f"on rank {r}. Give every rank the same model, CompileConfig and inputs"
            )
