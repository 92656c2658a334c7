"""Fuse the per-parameter collectives of a bucket into one.

All-gathers: copy-in (each padded shard flattened, concatenated) → one `all_gather_into_tensor` → wait → copy-out
(each parameter's columns of the `[world, total]` result, made contiguous, viewed as the padded parameter).
Reduce-scatters: each padded gradient viewed as `[world, rows * rest]`, concatenated on dim 1 → one
`reduce_scatter_tensor` → wait → [HSDP: one `all_reduce` of the reduced shards over the replicate group → wait]
→ per-parameter slices viewed as shards.

Buckets follow `CompileConfig.buckets`; a bucket holding several dtypes becomes one collective per dtype.
Needs: `lower_unshard` / `lower_reduce_grad` (their nodes carry `fsdp.params` and `fsdp.bucket`).
Provides: fused collectives whose `fsdp.params` lists every member.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import fx

from fsdp2_compile.graph import BUCKET, PARAMS, ROLE, ancestors_after, insert_call, positions, stable_topological_sort, val

aten = torch.ops.aten
funcol = torch.ops._c10d_functional
AG = funcol.all_gather_into_tensor.default
RS = funcol.reduce_scatter_tensor.default
AR = funcol.all_reduce.default
WAIT = funcol.wait_tensor.default


def _bucket_of(fqn: str, node: fx.Node, buckets) -> str:
    if buckets == "shard_calls":
        return node.meta[BUCKET]
    matches = [m for m in buckets if fqn == m or fqn.startswith(m + ".") or m == ""]
    return max(matches, key=len) if matches else "<rest>"


def _group(collectives: list[fx.Node], buckets) -> list[list[fx.Node]]:
    """Collectives (in graph order) split into buckets of one dtype and process group, in graph order."""
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    filled, index = 0, 0
    for node in collectives:
        inp = val(node.args[0])
        if isinstance(buckets, int):
            nbytes = inp.numel() * inp.element_size()
            if filled and filled + nbytes > buckets:
                index, filled = index + 1, 0
            filled += nbytes
            name = f"cap{index}"
        else:
            name = _bucket_of(node.meta[PARAMS][0], node, buckets)
        groups[(name, inp.dtype, node.args[-2], node.args[-1])].append(node)
    return [g for g in groups.values() if len(g) > 1]


def _wait_of(collective: fx.Node) -> fx.Node:
    [wait] = collective.users
    assert wait.target is WAIT
    return wait


def _fuse_all_gathers(graph: fx.Graph, members: list[fx.Node], hoist: dict[fx.Node, fx.Node]) -> None:
    """Fuse `members`; record in `hoist` the later members' copy-in nodes, to start with the fused copy-in."""
    first, world, group = members[0], members[0].args[1], members[0].args[2]
    params = tuple(p for m in members for p in m.meta[PARAMS])
    tag = lambda role: {PARAMS: params, BUCKET: first.meta[BUCKET], ROLE: role}  # noqa: E731
    pos = positions(graph)
    later_copy_in = [n for m in members[1:] for n in ancestors_after(m.args[0], pos[first], pos)]
    shards = [m.args[0] for m in members]
    sizes = [val(s).numel() for s in shards]
    with graph.inserting_before(first):
        flat = [insert_call(graph, aten.view.default, (s, [-1]), tag("copy_in")) for s in shards]
        packed = insert_call(graph, aten.cat.default, (flat,), tag("copy_in"))
        gathered = insert_call(graph, AG, (packed, world, group), tag("all_gather"))
        waited = insert_call(graph, WAIT, (gathered,), tag("wait"))
        table = insert_call(graph, aten.view.default, (waited, [world, sum(sizes)]), tag("copy_out"))
        offset = 0
        for m, shard, size in zip(members, shards, sizes):
            rows, *rest = val(shard).shape
            cols = insert_call(graph, aten.slice.Tensor, (table, 1, offset, offset + size), tag("copy_out"))
            dense = insert_call(
                graph, aten.clone.default, (cols,), tag("copy_out"), {"memory_format": torch.contiguous_format}
            )
            full = insert_call(graph, aten.view.default, (dense, [world * rows, *rest]), tag("copy_out"))
            _wait_of(m).replace_all_uses_with(full)
            offset += size
    for m in members:  # only now: `first` is the insertion point above
        graph.erase_node(_wait_of(m))
        graph.erase_node(m)
    for n in later_copy_in:
        hoist[n] = flat[0]


def _replica_all_reduce(reduce_scatter: fx.Node) -> fx.Node | None:
    """The HSDP all-reduce applied right after `reduce_scatter`'s wait, if there is one."""
    users = list(_wait_of(reduce_scatter).users)
    return users[0] if len(users) == 1 and users[0].target is AR else None


def _fuse_reduce_scatters(graph: fx.Graph, members: list[fx.Node]) -> None:
    last, world, group = members[-1], members[0].args[2], members[0].args[3]
    all_reduces = [_replica_all_reduce(m) for m in members]
    if None in all_reduces or len({a.args[1:] for a in all_reduces}) != 1:
        all_reduces = []
    params = tuple(p for m in members for p in m.meta[PARAMS])
    tag = lambda role: {PARAMS: params, BUCKET: last.meta[BUCKET], ROLE: role}  # noqa: E731
    grads = [m.args[0] for m in members]
    widths = [math.prod(val(g).shape) // world for g in grads]
    with graph.inserting_after(last):
        per_rank = [insert_call(graph, aten.view.default, (g, [world, w]), tag("copy_in")) for g, w in zip(grads, widths)]
        packed = insert_call(graph, aten.cat.default, (per_rank, 1), tag("copy_in"))
        flat = insert_call(graph, aten.view.default, (packed, [-1]), tag("copy_in"))
        reduced = insert_call(graph, RS, (flat, "avg", world, group), tag("reduce_scatter"))
        waited = insert_call(graph, WAIT, (reduced,), tag("wait"))
        if all_reduces:
            replicated = insert_call(graph, AR, (waited, *all_reduces[0].args[1:]), tag("all_reduce"))
            waited = insert_call(graph, WAIT, (replicated,), tag("wait"))
        offset = 0
        for final, g, width in zip(all_reduces or members, grads, widths):
            part = insert_call(graph, aten.slice.Tensor, (waited, 0, offset, offset + width), tag("copy_out"))
            shard = insert_call(graph, aten.view.default, (part, [val(g).shape[0] // world, *val(g).shape[1:]]), tag("copy_out"))
            _wait_of(final).replace_all_uses_with(shard)
            offset += width
    for collective in [*all_reduces, *members]:
        wait = _wait_of(collective)
        graph.erase_node(wait)
        graph.erase_node(collective)


def bucket_collectives(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    buckets = ctx.config.buckets
    if buckets == "none":
        return gm
    graph = gm.graph
    hoist: dict[fx.Node, fx.Node] = {}
    for members in _group([n for n in graph.nodes if n.target is AG], buckets):
        _fuse_all_gathers(graph, members, hoist)
    for members in _group([n for n in graph.nodes if n.target is RS], buckets):
        _fuse_reduce_scatters(graph, members)
    # Restore a topological order: hoisted copy-ins move up to their fused all-gather, and what used the earlier
    # members of a fused reduce-scatter moves down after it.
    pos = positions(graph)
    stable_topological_sort(gm, key=lambda n: pos[hoist[n]] - 0.5 if n in hoist else pos[n])
    return gm
