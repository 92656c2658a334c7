"""Lower every `fsdp2::unshard` into `[cast to param_dtype] → [pad] → all_gather_into_tensor → wait_tensor → [unpad]`,
after folding repeated unshards of one parameter (tied weights, a weight read twice) into the first: training
graphs get that from the partitioner's CSE, inference graphs do not.

Needs: nothing (runs on any forward, backward or inference graph). Provides: functional collectives tagged with
`fsdp.param_fqn` and `fsdp.role`. The cast comes before the all-gather, so a bf16 policy moves half the bytes.
"""

from __future__ import annotations

import torch
from torch import fx

from fsdp2_compile.graph import BUCKET, PARAMS, ROLE, insert_call, insert_contiguous, nodes_calling, val
from fsdp2_compile.ops import UNSHARD, padded_rows

aten = torch.ops.aten
funcol = torch.ops._c10d_functional


def _fold_repeated(graph: fx.Graph) -> None:
    """One `fsdp2::unshard` per parameter: its static args (fqn included) identify the parameter."""
    first: dict[tuple, fx.Node] = {}
    for node in nodes_calling(graph, UNSHARD):
        key = node.args[1:]
        if key not in first:
            first[key] = node
            continue
        shard = node.args[0]
        node.replace_all_uses_with(first[key])
        graph.erase_node(node)
        if shard.op == "call_function" and not shard.users:  # a view of the shard placeholder
            graph.erase_node(shard)


def lower_unshard(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    graph = gm.graph
    _fold_repeated(graph)
    for node in nodes_calling(graph, UNSHARD):
        shard, dim0, world_size, group_name, param_dtype, _reduce_dtype, fqn, bucket, *_ = node.args
        tag = lambda role: {PARAMS: (fqn,), BUCKET: bucket, ROLE: role}  # noqa: E731
        rows = padded_rows(dim0, world_size)
        with graph.inserting_before(node):
            x = shard
            if param_dtype is not None and param_dtype != val(x).dtype:
                x = insert_call(graph, torch.ops.prims.convert_element_type.default, (x, param_dtype), tag("cast"))
            missing = rows - val(x).shape[0]
            if missing:
                pad = [0, 0] * (val(x).dim() - 1) + [0, missing]
                x = insert_call(graph, aten.constant_pad_nd.default, (x, pad), tag("pad"))
            x = insert_contiguous(graph, x, tag("contiguous"))
            x = insert_call(graph, funcol.all_gather_into_tensor.default, (x, world_size, group_name), tag("all_gather"))
            x = insert_call(graph, funcol.wait_tensor.default, (x,), tag("wait"))
            if rows * world_size != dim0:
                x = insert_call(graph, aten.slice.Tensor, (x, 0, 0, dim0), tag("unpad"))
        node.replace_all_uses_with(x)
        graph.erase_node(node)
    return gm
