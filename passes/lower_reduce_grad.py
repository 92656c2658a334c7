"""Lower every `fsdp2::reduce_grad` into `[cast to reduce_dtype] → [pad] → reduce_scatter_tensor(avg) →
wait_tensor → [all_reduce(avg) over the HSDP replicate group → wait_tensor] → [unpad] → [cast to param dtype]`.

Needs: nothing (a no-op on graphs without gradients). Provides: functional collectives tagged with
`fsdp.param_fqn` and `fsdp.role`; the result is this rank's shard of the averaged gradient.
"""

from __future__ import annotations

import torch
from torch import fx

from fsdp2_compile.graph import BUCKET, PARAMS, ROLE, insert_call, insert_contiguous, nodes_calling, val
from fsdp2_compile.ops import REDUCE_GRAD, padded_rows

aten = torch.ops.aten
funcol = torch.ops._c10d_functional
convert = torch.ops.prims.convert_element_type.default


def lower_reduce_grad(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    graph = gm.graph
    for node in nodes_calling(graph, REDUCE_GRAD):
        grad, local_rows, world_size, group_name, reduce_dtype, out_dtype, fqn, bucket, replicas, replicate_group = node.args
        tag = lambda role: {PARAMS: (fqn,), BUCKET: bucket, ROLE: role}  # noqa: E731
        rows = padded_rows(val(grad).shape[0], world_size)
        with graph.inserting_before(node):
            x = grad
            if val(x).dtype != reduce_dtype:
                x = insert_call(graph, convert, (x, reduce_dtype), tag("cast"))
            missing = rows * world_size - val(x).shape[0]
            if missing:
                pad = [0, 0] * (val(x).dim() - 1) + [0, missing]
                x = insert_call(graph, aten.constant_pad_nd.default, (x, pad), tag("pad"))
            x = insert_contiguous(graph, x, tag("contiguous"))
            x = insert_call(
                graph, funcol.reduce_scatter_tensor.default, (x, "avg", world_size, group_name), tag("reduce_scatter")
            )
            x = insert_call(graph, funcol.wait_tensor.default, (x,), tag("wait"))
            if replicas > 1:
                x = insert_call(graph, funcol.all_reduce.default, (x, "avg", replicate_group), tag("all_reduce"))
                x = insert_call(graph, funcol.wait_tensor.default, (x,), tag("wait"))
            if local_rows != rows:
                x = insert_call(graph, aten.slice.Tensor, (x, 0, 0, local_rows), tag("unpad"))
            if reduce_dtype != out_dtype:
                x = insert_call(graph, convert, (x, out_dtype), tag("cast"))
        node.replace_all_uses_with(x)
        graph.erase_node(node)
    return gm
