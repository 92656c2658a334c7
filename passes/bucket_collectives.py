"""Fuse the per-parameter collectives of a bucket into one.

All-gathers: copy-in (each padded shard flattened, concatenated) → one `all_gather_into_tensor` → wait → copy-out
(each parameter's columns of the `[world, total]` result made contiguous — by one `split_with_sizes_copy`, as
`fully_shard` does, or for Inductor a clone each — and viewed as the padded parameter).
Reduce-scatters: each padded gradient viewed as `[world, rows * rest]`, concatenated on dim 1 → one
`reduce_scatter_tensor` → wait → [HSDP: one `all_reduce` of the reduced shards over the replicate group → wait]
→ [the members' all-reduce hook, called once on the flat result] → per-parameter slices viewed as shards. HSDP
over a shard group of one rank (no reduce-scatter): the gradients flattened and concatenated → one `all_reduce` over
the replicas → wait → [the hook, once] → per-parameter slices. A shard group of one has no all-gather: nothing to
fuse, no copy.

Buckets follow `CompileConfig.buckets`; a bucket holding several dtypes becomes one collective per dtype.
Contract: requires "unshard_lowered" and "reduce_grad_lowered" (collectives carrying `ir.Tags`: `fsdp.params`,
`fsdp.bucket`); provides "bucketed": fused collectives whose `fsdp.params` lists every member. Logs the bucket
plan (logger "fsdp2_compile").
"""

from __future__ import annotations

import logging
import math
import operator
from collections import defaultdict

import torch
from torch import fx

from fsdp2_compile.compiler.pass_api import Fact, PassContext, contract
from fsdp2_compile.core.fx_edit import ancestors_after, insert_call, insert_op, positions, stable_topological_sort, val
from fsdp2_compile.core.ir import (
    BUCKET,
    PARAMS,
    PREFETCH,
    RUN_ALL_REDUCE_HOOK,
    WAIT,
    AllGatherArgs,
    AllReduceArgs,
    CollectiveArgs,
    ReduceScatterArgs,
    Role,
    RunAllReduceHookArgs,
    Tags,
    WaitArgs,
    fsdp_collective_kind,
    nbytes,
)

aten = torch.ops.aten
AG, RS, AR = AllGatherArgs.op, ReduceScatterArgs.op, AllReduceArgs.op
log = logging.getLogger("fsdp2_compile")


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
        call = CollectiveArgs.of(node)
        inp = val(call.input)
        if isinstance(buckets, int):
            size = nbytes(inp)
            if filled and filled + size > buckets:
                index, filled = index + 1, 0
            filled += size
            name = f"cap{index}"
        else:
            name = _bucket_of(node.meta[PARAMS][0], node, buckets)
        key = (name, inp.dtype, getattr(call, "group_size", None), call.group_name, getattr(call, "reduce_op", None))
        groups[key].append(node)
    return [g for g in groups.values() if len(g) > 1]


def _wait_of(collective: fx.Node) -> fx.Node:
    [wait] = collective.users
    assert wait.target is WAIT
    return wait


def _fuse_all_gathers(graph: fx.Graph, members: list[fx.Node], hoist: dict[fx.Node, fx.Node], one_copy: bool) -> None:
    """Fuse `members`; record in `hoist` the later members' copy-in nodes, to start with the fused copy-in.
    `one_copy`: the copy-out as one `split_with_sizes_copy` (one op for the bucket); else a slice and a clone per
    member (what Inductor, which decomposes the former and fuses the copies itself, is given)."""
    first, call = members[0], AllGatherArgs.of(members[0])
    world = call.group_size
    params = tuple(p for m in members for p in m.meta[PARAMS])
    tag = Tags(params, first.meta[BUCKET]).meta
    pos = positions(graph)
    shards = [AllGatherArgs.of(m).input for m in members]
    later_copy_in = [n for s in shards[1:] for n in ancestors_after(s, pos[first], pos)]
    sizes = [val(s).numel() for s in shards]
    with graph.inserting_before(first):
        flat = [insert_call(graph, aten.view.default, (s, [-1]), tag(Role.COPY_IN)) for s in shards]
        packed = insert_call(graph, aten.cat.default, (flat,), tag(Role.COPY_IN))
        gathered = insert_op(graph, call.replace(input=packed), tag(Role.ALL_GATHER))
        prefetch = tuple(dict.fromkeys(b for m in members for b in m.meta.get(PREFETCH, ())))
        if prefetch:
            gathered.meta[PREFETCH] = prefetch
        waited = insert_op(graph, WaitArgs(gathered), tag(Role.WAIT))
        table = insert_call(graph, aten.view.default, (waited, [world, sum(sizes)]), tag(Role.COPY_OUT))
        if one_copy:
            columns = insert_call(graph, aten.split_with_sizes_copy.default, (table, sizes, 1), tag(Role.COPY_OUT))
        offset = 0
        for i, (m, shard, size) in enumerate(zip(members, shards, sizes)):
            rows, *rest = val(shard).shape
            if one_copy:
                dense = insert_call(graph, operator.getitem, (columns, i), tag(Role.COPY_OUT))
            else:
                cols = insert_call(graph, aten.slice.Tensor, (table, 1, offset, offset + size), tag(Role.COPY_OUT))
                dense = insert_call(
                    graph, aten.clone.default, (cols,), tag(Role.COPY_OUT), {"memory_format": torch.contiguous_format}
                )
            full = insert_call(graph, aten.view.default, (dense, [world * rows, *rest]), tag(Role.COPY_OUT))
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


def _hooks_of(finals: list[fx.Node]) -> list[fx.Node]:
    """The user's all-reduce hook applied right after each of `finals`' waits, if every one has the same hook: one
    call on the bucket's flat result serves them all (FSDP2 calls it once per group); else none."""
    hooks = [next(iter(_wait_of(f).users)) if len(_wait_of(f).users) == 1 else None for f in finals]
    if any(h is None or h.target is not RUN_ALL_REDUCE_HOOK for h in hooks):
        return []
    return hooks if len({RunAllReduceHookArgs.of(h).hook_key for h in hooks}) == 1 else []


def _fuse_reduce_scatters(graph: fx.Graph, members: list[fx.Node], order: dict[str, int]) -> None:
    last, call = members[-1], ReduceScatterArgs.of(members[0])
    if _hooks_of([_replica_all_reduce(m) or m for m in members]):
        # the hook gets FSDP2's flat buffer: its group's shards in the order `shard` took them (an all-reduce's
        # rounding may depend on where an element lies)
        members = sorted(members, key=lambda m: order.get(m.meta[PARAMS][0], 0))
    world = call.group_size
    all_reduces = [_replica_all_reduce(m) for m in members]
    if None in all_reduces or len({AllReduceArgs.of(a).static() for a in all_reduces}) != 1:
        all_reduces = []
    params = tuple(p for m in members for p in m.meta[PARAMS])
    tag = Tags(params, last.meta[BUCKET]).meta
    grads = [ReduceScatterArgs.of(m).input for m in members]
    widths = [math.prod(val(g).shape) // world for g in grads]
    with graph.inserting_after(last):
        per_rank = [
            insert_call(graph, aten.view.default, (g, [world, w]), tag(Role.COPY_IN)) for g, w in zip(grads, widths)
        ]
        packed = insert_call(graph, aten.cat.default, (per_rank, 1), tag(Role.COPY_IN))
        flat = insert_call(graph, aten.view.default, (packed, [-1]), tag(Role.COPY_IN))
        reduced = insert_op(graph, call.replace(input=flat), tag(Role.REDUCE_SCATTER))
        waited = insert_op(graph, WaitArgs(reduced), tag(Role.WAIT))
        if all_reduces:
            replicated = insert_op(graph, AllReduceArgs.of(all_reduces[0]).replace(input=waited), tag(Role.ALL_REDUCE))
            waited = insert_op(graph, WaitArgs(replicated), tag(Role.WAIT))
        hooks = _hooks_of(all_reduces or members)
        waited = _run_hook_once(graph, waited, hooks, Tags(params, last.meta[BUCKET]))
        parts = insert_call(graph, aten.split_with_sizes.default, (waited, widths), tag(Role.COPY_OUT))
        for i, (final, g) in enumerate(zip(all_reduces or members, grads)):
            part = insert_call(graph, operator.getitem, (parts, i), tag(Role.COPY_OUT))
            shard = insert_call(
                graph, aten.view.default, (part, [val(g).shape[0] // world, *val(g).shape[1:]]), tag(Role.COPY_OUT)
            )
            (hooks[i] if hooks else _wait_of(final)).replace_all_uses_with(shard)
    for hook in hooks:
        graph.erase_node(hook)
    for collective in [*all_reduces, *members]:
        wait = _wait_of(collective)
        graph.erase_node(wait)
        graph.erase_node(collective)


def _run_hook_once(graph: fx.Graph, waited: fx.Node, hooks: list[fx.Node], tags: Tags) -> fx.Node:
    """`waited` (a bucket's flat reduced gradients) through the members' one hook, if they have one."""
    if not hooks:
        return waited
    call = RunAllReduceHookArgs.of(hooks[0]).replace(reduced=waited, fqn=",".join(tags.params))
    return insert_op(graph, call, tags.meta(Role.ALL_REDUCE_HOOK))


def _after_reduce_scatter(all_reduce: fx.Node) -> bool:
    """Whether `all_reduce` reduces a reduce-scatter's result (HSDP; fused with it by `_fuse_reduce_scatters`, or
    after the kept partial shards were added), found back along the nodes the lowering inserted for it."""
    source = AllReduceArgs.of(all_reduce).input
    while isinstance(source, fx.Node) and PARAMS in source.meta:
        if source.target is WAIT and fsdp_collective_kind(WaitArgs.of(source).tensor) == Role.REDUCE_SCATTER:
            return True
        source = source.all_input_nodes[0] if source.all_input_nodes else None  # the data it was made from
    return False


def _fuse_all_reduces(graph: fx.Graph, members: list[fx.Node]) -> None:
    """HSDP over a shard group of one rank (no reduce-scatter): the members' gradients flattened and concatenated,
    one all-reduce over the replicas, each member's slice viewed in its shape."""
    last = members[-1]
    params = tuple(p for m in members for p in m.meta[PARAMS])
    tag = Tags(params, last.meta[BUCKET]).meta
    grads = [AllReduceArgs.of(m).input for m in members]
    with graph.inserting_after(last):
        flat = [insert_call(graph, aten.view.default, (g, [-1]), tag(Role.COPY_IN)) for g in grads]
        packed = insert_call(graph, aten.cat.default, (flat,), tag(Role.COPY_IN))
        reduced = insert_op(graph, AllReduceArgs.of(members[0]).replace(input=packed), tag(Role.ALL_REDUCE))
        waited = insert_op(graph, WaitArgs(reduced), tag(Role.WAIT))
        hooks = _hooks_of(members)
        waited = _run_hook_once(graph, waited, hooks, Tags(params, last.meta[BUCKET]))
        parts = insert_call(
            graph, aten.split_with_sizes.default, (waited, [math.prod(val(g).shape) for g in grads]), tag(Role.COPY_OUT)
        )
        for i, (m, g) in enumerate(zip(members, grads)):
            part = insert_call(graph, operator.getitem, (parts, i), tag(Role.COPY_OUT))
            out = insert_call(graph, aten.view.default, (part, list(val(g).shape)), tag(Role.COPY_OUT))
            (hooks[i] if hooks else _wait_of(m)).replace_all_uses_with(out)
    for hook in hooks:
        graph.erase_node(hook)
    for m in members:
        graph.erase_node(_wait_of(m))
        graph.erase_node(m)


def _log_bucket(ctx: PassContext, kind: Role, members: list[fx.Node]) -> None:
    if log.isEnabledFor(logging.INFO):
        params = [p for m in members for p in m.meta[PARAMS]]
        size = sum(nbytes(val(CollectiveArgs.of(m).input)) for m in members)
        log.info(
            "%s graph: bucket %r fuses %d %s collectives (%d bytes of input): %s",
            ctx.kind,
            members[0].meta[BUCKET],
            len(members),
            kind,
            size,
            ", ".join(params),
        )


@contract(requires=(Fact.UNSHARD_LOWERED, Fact.REDUCE_GRAD_LOWERED), provides=(Fact.BUCKETED,))
def bucket_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    buckets = ctx.config.buckets
    if buckets == "none":
        return gm
    graph = gm.graph
    hoist: dict[fx.Node, fx.Node] = {}
    for members in _group([n for n in graph.nodes if fsdp_collective_kind(n) == Role.ALL_GATHER], buckets):
        _log_bucket(ctx, Role.ALL_GATHER, members)
        _fuse_all_gathers(graph, members, hoist, one_copy=ctx.config.compiler != "inductor")
    for members in _group([n for n in graph.nodes if fsdp_collective_kind(n) == Role.REDUCE_SCATTER], buckets):
        _log_bucket(ctx, Role.REDUCE_SCATTER, members)
        _fuse_reduce_scatters(graph, members, ctx.param_order)
    alone = [n for n in graph.nodes if fsdp_collective_kind(n) == Role.ALL_REDUCE and not _after_reduce_scatter(n)]
    for members in _group(alone, buckets):
        _log_bucket(ctx, Role.ALL_REDUCE, members)
        _fuse_all_reduces(graph, members)
    # Restore a topological order: hoisted copy-ins move up to just before their fused all-gather's first copy-in
    # (rank 0 at that position, the node there rank 1), and what used the earlier members of a fused
    # reduce-scatter moves down after it.
    pos = positions(graph)
    stable_topological_sort(gm, key=lambda n: (pos[hoist[n]], 0) if n in hoist else (pos[n], 1))
    return gm
