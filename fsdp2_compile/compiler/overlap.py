"""The collectives of a lowered graph as units that can be moved, and emitting a graph order from a plan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from torch import fx

from fsdp2_compile.compiler.selective_unshard import KeptGathered
from fsdp2_compile.core.fx_edit import positions, stable_topological_sort
from fsdp2_compile.core.ir import (
    BUCKET,
    DELIVER_GRAD,
    PREFETCH,
    ROLE,
    AllReduceArgs,
    CollectiveArgs,
    Role,
    fsdp_collective_kind,
    nbytes,
    val,
)

__all__ = ["Rank", "Unit", "anchors_at", "emit_order", "find_units", "graph_start", "memory_budget", "order_keys"]

_START_ROLES = {Role.TO_DEVICE, Role.CAST, Role.PAD, Role.CONTIGUOUS, Role.COPY_IN}
"""Roles of the nodes before a collective that move with it (its copy-in chain)."""
_FINISH_ROLES = {Role.WAIT, Role.COPY_OUT, Role.UNPAD, Role.CAST, Role.TO_DEVICE}
"""Roles of the nodes after a collective that move with its wait (its copy-out chain)."""


# A unit is one (possibly bucketed) collective with the nodes that must move with it: `start` (its copy-in chain and
# the collective itself) and `finish` (its wait and the copy-out chain). An order is emitted by a stable topological
# sort: each all-gather's start goes right before its *anchor* (the node it must be issued ahead of), its finish right
# before its first use; reduce-scatters start as soon as their gradients exist and finish at the very end — except
# under HSDP, where a reduce-scatter finishes just before the next one starts and its all-reduce over the replicas
# starts right then, so both overlap the rest of the backward; all-reduces finish at the end. A reduction (the
# reduce-scatter, or under HSDP the all-reduce) whose gradients are delivered inside backward (`grad_delivery.py`)
# finishes just before the next one of its kind starts; its deliveries (the parameters' hooks: an optimizer step) run
# right after that one is issued.
@dataclass
class Unit:
    kind: Role
    """`Role.ALL_GATHER`, `REDUCE_SCATTER` or `ALL_REDUCE` (HSDP: over the replicas, after a reduce-scatter)."""
    collective: fx.Node
    start: list[fx.Node]
    finish: list[fx.Node]
    first_use: fx.Node
    """The first node outside `finish` that uses its result (the output node for gradients)."""
    nbytes: int
    """Bytes of the full (gathered or to-be-reduced) buffer."""


def _start_nodes(collective: fx.Node, kind: str) -> list[fx.Node]:
    """The collective and the ancestors that move with it: for an all-gather every non-placeholder ancestor (views
    and casts of the shards: cheap, and free of compute), otherwise only its tagged copy-in."""
    found, stack = [collective], [collective]
    while stack:
        for producer in stack.pop().all_input_nodes:
            movable = producer.op != "placeholder" and (
                kind == Role.ALL_GATHER or producer.meta.get(ROLE) in _START_ROLES
            )
            if movable and producer not in found:
                found.append(producer)
                stack.append(producer)
    return found


def _finish_nodes(collective: fx.Node) -> list[fx.Node]:
    found, stack = [], [collective]
    while stack:
        for user in stack.pop().users:
            if user.meta.get(ROLE) in _FINISH_ROLES and user not in found:
                found.append(user)
                stack.append(user)
    return found


def find_units(gm: fx.GraphModule) -> list[Unit]:
    """Every FSDP collective of the graph as a unit, all-gathers ordered by first use, then the others in graph
    order (tensor parallelism's collectives are not units: they stay with their compute)."""
    pos = positions(gm.graph)
    units = []
    for node in gm.graph.nodes:
        kind = fsdp_collective_kind(node)
        if kind is None:
            continue
        finish = _finish_nodes(node)
        users = [u for n in finish for u in n.users if u not in finish] or [gm.graph.output_node()]
        full = val(node) if kind == Role.ALL_GATHER else val(CollectiveArgs.of(node).input)
        units.append(Unit(kind, node, _start_nodes(node, kind), finish, min(users, key=pos.__getitem__), nbytes(full)))
    gathers = sorted((u for u in units if u.kind == Role.ALL_GATHER), key=lambda u: pos[u.first_use])
    return gathers + [u for u in units if u.kind != Role.ALL_GATHER]


def graph_start(gm: fx.GraphModule) -> fx.Node:
    """The graph's first node after its placeholders: where a gather no earlier bucket precedes starts (the
    backward's first buckets are gathered while the loss and the head compute their gradients, not after)."""
    return next(n for n in gm.graph.nodes if n.op != "placeholder")


def anchors_at(gathers: list[Unit], distances: list[int], start: fx.Node) -> dict[fx.Node, fx.Node]:
    """Gather k (in first-use order) starts `distances[k]` gathers early: right before gather k-d's first use, or at
    the graph's `start` when k-d < 0 — unless a bucket used before it asked to prefetch it (`ir.PREFETCH`, set by
    `set_modules_to_*_prefetch`): then right before the first such bucket's first use."""
    anchors = {
        u.collective: gathers[k - d].first_use if d <= k else start for k, (u, d) in enumerate(zip(gathers, distances))
    }
    for k, u in enumerate(gathers):
        for asking in gathers[:k]:
            if u.collective.meta.get(BUCKET) in asking.collective.meta.get(PREFETCH, ()):
                anchors[u.collective] = asking.first_use
                break
    return anchors


class Rank(IntEnum):
    """Where a node goes among those placed at one slot (the position of a node in the current order): the rule
    `emit_order` sorts by, smallest first. A sort key is `(slot, rank)`."""

    REPLICA_WAIT = 0
    """HSDP, or a bucket whose gradients are delivered (`fsdp2::deliver_grad`, optimizer in backward): a
    reduction's wait, just before the next reduction of its kind is issued at this slot; the deliveries go right
    after that issue."""
    REPLICA_START = 1
    """HSDP: the all-reduce over the replicas of that reduce-scatter's result, issued right after its wait."""
    ISSUE = 2
    """Collectives issued before the node at this slot: all-gathers anchored here, and reduce-scatters whose last
    input is the node of the previous slot (at one rank: ties keep the current order)."""
    GATHER_WAIT = 3
    """An all-gather's wait and copy-out, right before the first use at this slot."""
    NODE = 4
    """The node that was at this slot (every node `emit_order` does not move)."""
    AFTER = 5
    """Right after a key of another kind (past the end: all-reduces issued after the last waits)."""


Key = tuple[int, ...]


def _after(key: Key) -> Key:
    """A collective issued right after the node with `key`: before the next slot's node, with what is issued there."""
    slot, rank, *rest = key
    return (slot + 1, Rank.ISSUE) if rank == Rank.NODE and not rest else (*key, Rank.AFTER)


def emit_order(gm: fx.GraphModule, units: list[Unit], anchors: dict[fx.Node, fx.Node]) -> None:
    """Reorder `gm` by a stable topological sort whose key states the rule (`Rank`): all-gather `u` is issued
    right before `anchors[u.collective]` and waited for right before its first use; a reduce-scatter is issued
    right after its last input and waited for at the end (or, when an HSDP all-reduce follows, just before the
    next reduce-scatter is issued, its all-reduce issued right then); all-reduces are waited for at the end. A
    reduction whose gradients are delivered is waited for just before the next of its kind is issued, and its
    deliveries run right after that issue. Other nodes keep their order; among nodes of one slot and rank the
    current order decides."""
    stable_topological_sort(gm, key=order_keys(gm, units, anchors))


def order_keys(gm: fx.GraphModule, units: list[Unit], anchors: dict[fx.Node, fx.Node]) -> Callable[[fx.Node], Key]:
    """The sort key of every node of `gm` under `emit_order`'s rule."""
    pos = positions(gm.graph)
    end: Key = (len(pos) + 1, Rank.NODE)
    key: dict[fx.Node, Key] = {}

    def current(n: fx.Node) -> Key:
        return key.get(n, (pos[n], Rank.NODE))

    def last_input(u: Unit) -> Key:
        return max(current(p) for n in u.start for p in n.all_input_nodes if p not in u.start)

    for u in units:
        if u.kind == Role.ALL_GATHER:
            for n in u.start:
                key[n] = (pos[anchors.get(u.collective, u.first_use)], Rank.ISSUE)
            for n in u.finish:
                key[n] = (pos[u.first_use], Rank.GATHER_WAIT)
    reduce_scatters = [u for u in units if u.kind == Role.REDUCE_SCATTER]
    for u in reduce_scatters:
        issue = _after(last_input(u))
        for n in u.start:
            key[n] = issue
    _place_finishes(reduce_scatters, key, end, replicated=True)
    all_reduces = [u for u in units if u.kind == Role.ALL_REDUCE]
    for u in all_reduces:
        wait = last_input(u)  # its reduce-scatter's wait: just before the next reduce-scatter, or at the end
        issue = (*wait[:-1], Rank.REPLICA_START) if wait[-1] == Rank.REPLICA_WAIT else (*wait, Rank.AFTER)
        for n in u.start:
            key[n] = issue
    _place_finishes(all_reduces, key, end, replicated=False)
    return current


def _place_finishes(units: list[Unit], key: dict[fx.Node, Key], end: Key, replicated: bool) -> None:
    """Keys of the waits (and copy-outs) of `units`, reductions of one kind in issue order: at the end, or just
    before the next one is issued when the result is all-reduced next (`replicated`: HSDP's reduce-scatters) or
    delivered (`fsdp2::deliver_grad`); deliveries right after that next one is issued, so the hooks run while it
    is in flight (and before that one's wait, should it be the last and issued at the end)."""
    deliveries: Key | None = None  # where the previous unit's deliveries went
    for u, later in zip(units, units[1:] + [None]):
        users = [user for n in u.finish for user in n.users]
        delivered = [user for user in users if user.target is DELIVER_GRAD]
        early = later is not None and (
            delivered or replicated and any(user.target is AllReduceArgs.op for user in users)
        )
        finish = (*key[later.collective][:-1], Rank.REPLICA_WAIT) if early else end
        if deliveries is not None and deliveries > finish:
            finish = (*deliveries, Rank.AFTER)
        for n in u.finish:
            key[n] = finish
        deliveries = _after(key[later.collective]) if early and delivered else None
        for n in delivered if early else ():
            key[n] = deliveries


def memory_budget(config, gathers: list[Unit], kept: KeptGathered | None = None) -> int:
    """Bytes of gathered buckets the prefetch window may hold at once: the config's budget less what selective
    unsharding keeps gathered (`kept`, alive beside the window), or `prefetch_depth + 1` largest buckets."""
    if config.memory_budget_bytes is not None:
        return config.memory_budget_bytes - (kept.kept_bytes if kept is not None else 0)
    return (config.prefetch_depth + 1) * max((u.nbytes for u in gathers), default=0)
