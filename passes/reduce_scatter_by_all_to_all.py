"""On gloo, carry out each reduce-scatter of a two-rank group as an all-to-all and a local sum.

gloo has no reduce-scatter of its own: `ProcessGroupGloo` all-reduces the whole buffer and keeps this rank's part,
so it moves twice a reduce-scatter's bytes (the cpu-gloo-1gbit `reduce_scatter_factor` in
data/hardware_profiles.json, with its source). An all-to-all moves exactly a reduce-scatter's bytes. With two ranks the local sum
x_0 + x_1 is the one addition gloo makes (commutative, so either order), and an average divides it by two as gloo
does: results stay bitwise equal. Larger groups keep gloo's reduce-scatter (its ring adds in an order that depends
on the rank and the buffer size), as do complex gradients (gloo's all-to-all has no complex dtypes).

`reduce_scatter(x) → wait` becomes `all_to_all_single(x) → wait → first half + second half [→ / 2 for "avg"]`. The
all-to-all keeps the reduce-scatter's place and tags (`ir.collective_kind` counts it as a reduce-scatter), so it
runs after the schedule, which it does not change; before `keep_inputs_until_wait`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx

from fsdp2_compile._torch_private import one_thread_gloo_backend, resolve_group
from fsdp2_compile.compiler.pass_api import Fact, PassContext, contract
from fsdp2_compile.core.fx_edit import insert_call, insert_op, tags_of, val
from fsdp2_compile.core.ir import ROLE, WAIT, AllToAllArgs, ReduceScatterArgs, Role, fsdp_collective_kind

aten = torch.ops.aten


def _on_gloo(group_name: str) -> bool:
    return dist.get_backend(resolve_group(group_name)) in ("gloo", one_thread_gloo_backend())


@contract(requires=(Fact.ORDERED,))
def reduce_scatter_by_all_to_all(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    for node in [n for n in graph.nodes if fsdp_collective_kind(n) == Role.REDUCE_SCATTER]:
        rs = ReduceScatterArgs.of(node)
        if rs.group_size != 2 or val(rs.input).is_complex() or not _on_gloo(rs.group_name):
            continue
        [wait] = node.users
        assert wait.target is WAIT
        rows = val(node).shape[0]
        tags = tags_of(node)
        with graph.inserting_before(node):
            a2a = insert_op(graph, AllToAllArgs(rs.input, [rows, rows], [rows, rows], rs.group_name), tags)
        wait.args = (a2a,)
        wait.meta["val"] = val(a2a)
        tag = tags | {ROLE: Role.LOCAL_REDUCE}
        with graph.inserting_after(wait):
            first = insert_call(graph, aten.slice.Tensor, (wait, 0, 0, rows), tag)
        with graph.inserting_after(first):
            second = insert_call(graph, aten.slice.Tensor, (wait, 0, rows, 2 * rows), tag)
        with graph.inserting_after(second):
            out = insert_call(graph, aten.add.Tensor, (first, second), tag)
        if rs.reduce_op == "avg":
            with graph.inserting_after(out):
                out = insert_call(graph, aten.div.Tensor, (out, 2), tag)
        for user in list(wait.users):
            if user is not first and user is not second:
                user.replace_input_with(wait, out)
        graph.erase_node(node)
    return gm
