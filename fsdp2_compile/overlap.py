"""The collectives of a lowered graph as units that can be moved, and emitting a graph order from a plan.

A unit is one (possibly bucketed) collective with the nodes that must move with it: `start` (its copy-in chain and
the collective itself) and `finish` (its wait and the copy-out chain). An order is emitted by a stable topological
sort: each all-gather's start goes right before its *anchor* (the node it must be issued ahead of), its finish right
before its first use; reduce-scatters start as soon as their gradients exist and finish at the very end — except
under HSDP, where a reduce-scatter finishes just before the next one starts and its all-reduce over the replicas
starts right then, so both overlap the rest of the backward; all-reduces finish at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from .graph import positions, stable_topological_sort
from .ir import ROLE, AllReduceArgs, CollectiveArgs, Role, collective_kind, nbytes, val

__all__ = ["Unit", "anchors_at", "emit_order", "find_units", "memory_budget"]

_START_ROLES = {Role.CAST, Role.PAD, Role.CONTIGUOUS, Role.COPY_IN}
"""Roles of the nodes before a collective that move with it (its copy-in chain)."""
_FINISH_ROLES = {Role.WAIT, Role.COPY_OUT, Role.UNPAD, Role.CAST}
"""Roles of the nodes after a collective that move with its wait (its copy-out chain)."""


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
    """Every collective of the graph as a unit, all-gathers ordered by first use, then the others in graph order."""
    pos = positions(gm.graph)
    units = []
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        finish = _finish_nodes(node)
        users = [u for n in finish for u in n.users if u not in finish] or [gm.graph.output_node()]
        full = val(node) if kind == Role.ALL_GATHER else val(CollectiveArgs.of(node).input)
        units.append(Unit(kind, node, _start_nodes(node, kind), finish, min(users, key=pos.__getitem__), nbytes(full)))
    gathers = sorted((u for u in units if u.kind == Role.ALL_GATHER), key=lambda u: pos[u.first_use])
    return gathers + [u for u in units if u.kind != Role.ALL_GATHER]


def anchors_at(gathers: list[Unit], distances: list[int]) -> dict[fx.Node, fx.Node]:
    """Gather k (in first-use order) starts `distances[k]` gathers early: right before gather k-d's first use."""
    return {u.collective: gathers[k - d].first_use for k, (u, d) in enumerate(zip(gathers, distances))}


def emit_order(gm: fx.GraphModule, units: list[Unit], anchors: dict[fx.Node, fx.Node]) -> None:
    """Reorder `gm`: all-gather `u` starts right before `anchors[u.collective]` and finishes right before its first
    use; reduce-scatters start after their last input and finish at the end (or, when an HSDP all-reduce follows,
    just before the next reduce-scatter starts); all-reduces start right after their input. Other nodes keep
    their order."""
    pos = positions(gm.graph)
    end = len(pos) + 1.0
    key: dict[fx.Node, float] = {}

    def start_after_inputs(u: Unit, gap: float) -> None:
        inputs = [p for n in u.start for p in n.all_input_nodes if p not in u.start]
        for n in u.start:
            key[n] = max(key.get(p, pos[p]) for p in inputs) + gap

    for u in units:
        if u.kind == Role.ALL_GATHER:
            for n in u.start:
                key[n] = pos[anchors.get(u.collective, u.first_use)] - 0.75
            for n in u.finish:
                key[n] = pos[u.first_use] - 0.5
    reduce_scatters = [u for u in units if u.kind == Role.REDUCE_SCATTER]
    for u in reduce_scatters:
        start_after_inputs(u, 0.25)
    for u, later in zip(reduce_scatters, reduce_scatters[1:] + [None]):
        replicated = any(user.target is AllReduceArgs.op for n in u.finish for user in n.users)
        for n in u.finish:
            key[n] = key[later.collective] - 0.1 if replicated and later is not None else end
    for u in units:
        if u.kind == Role.ALL_REDUCE:
            start_after_inputs(u, 0.05)
            for n in u.finish:
                key[n] = end
    stable_topological_sort(gm, key=lambda n: key.get(n, pos[n]))


def memory_budget(config, gathers: list[Unit]) -> int:
    """Bytes of gathered buckets allowed alive at once: the config's, or `prefetch_depth + 1` largest buckets."""
    if config.memory_budget_bytes is not None:
        return config.memory_budget_bytes
    return (config.prefetch_depth + 1) * max((u.nbytes for u in gathers), default=0)
