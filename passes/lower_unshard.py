"""Lower every `fsdp2::unshard` into `[copy to the compute device] → [cast to param_dtype] → [pad] →
all_gather_into_tensor → wait_tensor → [unpad]` — over a shard group of one rank into `[copy to the compute
device] → [cast to param_dtype] → [contiguous]` alone: no collective, no copy — or, for a parameter the last
backward kept gathered (`set_reshard_after_backward(False)`), into that tensor and `fsdp2::release_unsharded` (the
forward has taken it) — after folding repeated unshards of one parameter (tied weights, a weight read twice) into
the first: training graphs get that from the partitioner's CSE, inference graphs do not.

Runs on any forward, backward or inference graph. Every node it inserts carries `ir.Tags` (`fsdp.params`: the
parameter, `fsdp.bucket`: its `shard` call, `fsdp.role`: an `ir.Role`); an all-gather also carries the buckets
its module asked to prefetch in this graph's direction (`fsdp.prefetch`). The cast comes before the all-gather, so
a bf16 policy moves half the bytes.
"""

from __future__ import annotations

import torch
from torch import fx

from fsdp2_compile._torch_private import to_copy
from fsdp2_compile.compiler.pass_api import Fact, PassContext, contract
from fsdp2_compile.core.fx_edit import (
    fold_repeated_unshards,
    insert_call,
    insert_contiguous,
    insert_op,
    nodes_calling,
    val,
)
from fsdp2_compile.core.ir import (
    PREFETCH,
    UNSHARD,
    AllGatherArgs,
    ReleaseUnshardedArgs,
    Role,
    Tags,
    UnshardArgs,
    WaitArgs,
)
from fsdp2_compile.core.ops import padded_rows

aten = torch.ops.aten


@contract(provides=(Fact.UNSHARD_LOWERED,))
def lower_unshard(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    fold_repeated_unshards(graph)
    for node in nodes_calling(graph, UNSHARD):
        a = UnshardArgs.of(node)
        tag = Tags((a.fqn,), a.bucket).meta
        if a.gathered is not None:  # kept by the last backward (reshard_after_backward off): nothing to gather
            with graph.inserting_before(node):
                insert_op(graph, ReleaseUnshardedArgs(a.kept_key), tag())
            node.replace_all_uses_with(a.gathered)
            graph.erase_node(node)
            continue
        rows = padded_rows(a.dim0, a.world_size)
        with graph.inserting_before(node):
            x = a.shard
            if a.compute_device is not None and a.compute_device != val(x).device:
                x = insert_call(
                    graph,
                    to_copy.default,
                    (x,),
                    tag(Role.TO_DEVICE),
                    {"device": a.compute_device, "non_blocking": True},
                )
            if a.param_dtype is not None and a.param_dtype != val(x).dtype:
                x = insert_call(graph, torch.ops.prims.convert_element_type.default, (x, a.param_dtype), tag(Role.CAST))
            if a.world_size == 1:
                x = _alone(graph, x, a, tag)
                node.replace_all_uses_with(x)
                graph.erase_node(node)
                continue
            missing = rows - val(x).shape[0]
            if missing:
                pad = [0, 0] * (val(x).dim() - 1) + [0, missing]
                x = insert_call(graph, aten.constant_pad_nd.default, (x, pad), tag(Role.PAD))
            x = insert_contiguous(graph, x, tag(Role.CONTIGUOUS))
            x = insert_op(graph, AllGatherArgs(x, a.world_size, a.group_name), tag(Role.ALL_GATHER))
            prefetch = a.prefetch_backward if ctx.kind == "backward" else a.prefetch_forward
            if prefetch:
                x.meta[PREFETCH] = tuple(prefetch.split(","))
            x = insert_op(graph, WaitArgs(x), tag(Role.WAIT))
            if rows * a.world_size != a.dim0:
                x = insert_call(graph, aten.slice.Tensor, (x, 0, 0, a.dim0), tag(Role.UNPAD))
        node.replace_all_uses_with(x)
        graph.erase_node(node)
    return gm


def _alone(graph: fx.Graph, x: fx.Node, a, tag) -> fx.Node:
    """The gathered parameter of a shard group of one rank: the shard (`x`, cast or copied to the compute device
    when asked) made contiguous if it is not; copied only when it is the shard itself and its gradient is delivered
    inside backward (`a.grad_key`: the hooks step the shard in place while backward may still read the gathered
    value, which FSDP2 holds in a buffer of its own)."""
    dense = insert_contiguous(graph, x, tag(Role.CONTIGUOUS))
    if dense is a.shard and a.grad_key:
        dense = insert_call(graph, aten.clone.default, (dense,), tag())
    return dense
