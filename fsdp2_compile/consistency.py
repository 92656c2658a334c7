"""Rank consistency: every rank must issue the same collectives in the same order, or the job hangs.

After compiling a graph, each rank publishes the sequence of its collectives (kind, dtype, bytes) in the process
group's store and reads every other rank's; any difference raises, on every rank, an error naming the ranks and
the first differing collective and the parameters one rank gathers or reduces but the other does not (e.g. a
parameter used under `if rank == 0:`). A rank that never publishes (it failed to compile) makes the others raise after
`timeout_s` instead of hanging in the first collective.

Graphs are paired across ranks by their Dynamo frame (numbered in the order the fsdp2 backend first meets it) and
kind. A recompile of a frame whose schedule the ranks already agreed on (e.g. for a new input shape, which ranks
with different data meet at different steps) is not checked again, so it never waits for the other ranks; only a
new schedule for a frame (e.g. after `set_requires_gradient_sync`, which every rank calls together) is.
"""

from __future__ import annotations

import hashlib
import itertools
from datetime import timedelta

import torch.distributed as dist
from torch import fx

from ._torch_private import current_compile_id, default_store
from .report import collectives

__all__ = ["check_same_schedule", "schedule_signature"]

_counter = itertools.count()
_FRAMES: dict[int, int] = {}
"""Dynamo frame id -> the order in which the fsdp2 backend first compiled it (the same on every rank)."""
_AGREED: dict[tuple[str, str], list[str]] = {}
"""(frame, kind) -> the schedules all ranks agreed on for it, in order."""


def schedule_signature(gm: fx.GraphModule) -> str:
    """The collectives of `gm` in order, one `kind:dtype:bytes:param,param,...` per line."""
    return "\n".join(
        f"{c.kind}:{str(c.dtype).removeprefix('torch.')}:{c.nbytes}:{','.join(c.params)}" for c in collectives(gm)
    )


def _served(lines: list[str]) -> set[tuple[str, str]]:
    """(collective kind, parameter) for every parameter the collectives of a signature serve."""
    return {(line.split(":", 1)[0], p) for line in lines for p in line.split(":", 3)[3].split(",") if p}


def _only_on(rank: int, served: set[tuple[str, str]]) -> str:
    """"; all_gather of a, b on rank 0 only" per collective kind ("" when `served` is empty)."""
    kinds = sorted({kind for kind, _ in served})
    return "".join(
        f"; {kind} of {', '.join(sorted(p for k, p in served if k == kind))} on rank {rank} only" for kind in kinds
    )


def _short(lines: list[str], i: int) -> str:
    """Collective #i of a signature without its parameter list ("none" past the end)."""
    return lines[i].rsplit(":", 1)[0] if i < len(lines) else "none"


def check_same_schedule(gm: fx.GraphModule, kind: str, timeout_s: float = 120.0) -> None:
    """Raise on every rank if the ranks compiled different collective schedules for this graph."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    mine = schedule_signature(gm)
    compile_id = current_compile_id()
    frame = f"f{_FRAMES.setdefault(compile_id[0], len(_FRAMES))}" if compile_id else f"n{next(_counter)}"
    agreed = _AGREED.setdefault((frame, kind), [])
    if mine in agreed:
        return
    store = default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"fsdp2_compile/schedule/{frame}/{kind}/{len(agreed)}"
    store.set(f"{key}/{rank}", mine)
    keys = [f"{key}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as e:  # a timeout: some rank never published
        missing = [r for r in range(world) if not store.check([f"{key}/{r}"])]
        raise RuntimeError(
            f"fsdp2_compile: rank(s) {missing} did not publish their {kind} schedule within {timeout_s:.0f} s "
            "(they failed to compile, or compiled different graphs: e.g. a data-dependent branch went another way "
            "there, so they did not need this graph); look at their errors, and keep control flow the same on "
            "every rank"
        ) from e
    for r in range(world):
        theirs = store.get(f"{key}/{r}").decode()
        if theirs != mine:
            ours, other = mine.splitlines(), theirs.splitlines()
            i = next((i for i, (a, b) in enumerate(zip(ours, other)) if a != b), min(len(ours), len(other)))
            params = _only_on(rank, _served(ours) - _served(other)) + _only_on(r, _served(other) - _served(ours))
            raise RuntimeError(
                f"fsdp2_compile: rank {rank} and rank {r} compiled different {kind} schedules "
                f"(sha256 {hashlib.sha256(mine.encode()).hexdigest()[:12]} vs {hashlib.sha256(theirs.encode()).hexdigest()[:12]}); "
                f"collective #{i}: {_short(ours, i)} here vs {_short(other, i)} on rank {r}{params}. "
                "Give every rank the same model, CompileConfig and inputs, and use every parameter on every rank "
                "(not under a rank-dependent branch)"
            )
    agreed.append(mine)
