"""Groups split back into per-parameter ops: `fsdp2::unshard_group` (`core/grouped_unshard.py`) becomes one
`fsdp2::unshard` per parameter before the partitioner tags the gathers (in an inference graph, before the passes);
`fsdp2::reduce_group` becomes each parameter's backward ops right after the partition. Nothing after sees a group.
"""

from __future__ import annotations

from torch import fx

from fsdp2_compile.core.fx_edit import insert_call, tags_of
from fsdp2_compile.core.grouped_unshard import GROUPS, REDUCE_GROUP, REDUCTIONS, UNSHARD_GROUP
from fsdp2_compile.core.ir import UNSHARD, ReduceGroupArgs, UnshardGroupArgs, output_of
from fsdp2_compile.core.ops import shard_grad

__all__ = ["split_reduce_groups", "split_unshard_groups"]


def split_unshard_groups(gm: fx.GraphModule) -> None:
    """Replace every `fsdp2::unshard_group` of `gm` (and its `getitem`s) by one `fsdp2::unshard` per shard."""
    groups = list(gm.graph.find_nodes(op="call_function", target=UNSHARD_GROUP))
    for group in groups:
        call = UnshardGroupArgs.of(group)
        for user, i in _outputs(group):
            with gm.graph.inserting_before(user):
                node = gm.graph.call_function(UNSHARD, (call.shards[i], GROUPS[call.key][i]))
            node.meta.update(group.meta)
            node.meta.update(user.meta)
            user.replace_all_uses_with(node)
            gm.graph.erase_node(user)
        gm.graph.erase_node(group)
    if groups:
        gm.graph.lint()  # its code is generated after the passes (AOTAutograd copies a backward graph anew)


def split_reduce_groups(gm: fx.GraphModule) -> None:
    """Replace every `fsdp2::reduce_group` of `gm` (a backward graph) by each parameter's own ops, in order, as
    `fsdp2::unshard`'s backward makes them (`ops.shard_grad`)."""
    groups = list(gm.graph.find_nodes(op="call_function", target=REDUCE_GROUP))
    for group in groups:
        call = ReduceGroupArgs.of(group)
        meta = tags_of(group)
        with gm.graph.inserting_before(group):
            reduced = [
                shard_grad(f, g, lambda op, *args, meta=meta: insert_call(gm.graph, op, args, meta))
                for f, g in zip(REDUCTIONS[call.key], call.grads)
            ]
        for user, i in _outputs(group):
            user.replace_all_uses_with(reduced[i])
            gm.graph.erase_node(user)
        gm.graph.erase_node(group)
    if groups:
        gm.graph.lint()  # its code is generated after the passes (AOTAutograd copies a backward graph anew)


def _outputs(group: fx.Node) -> list[tuple[fx.Node, int]]:
    """(getitem node, index) of each read of one of `group`'s outputs."""
    found = []
    for user in list(group.users):
        source = output_of(user)
        if source is None:
            raise RuntimeError(f"fsdp2_compile: {user.format_node()} reads {group.name}'s outputs whole")
        found.append((user, source[1]))
    return found
