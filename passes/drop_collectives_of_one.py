"""Drop the collectives already in the captured graph whose process group has one rank — torchao float8's amax
all-reduce over a shard group of one, tensor parallelism's redistributions over a mesh dimension of size one: each
collective and its wait become the collective's input (over one rank every functional collective returns its
input's values). FSDP's own collectives over a group of one are never inserted (`lower_unshard`,
`lower_reduce_grad`).

Runs on any graph, before the lowering; leaves a graph without such collectives untouched. A collective whose input
is a graph input gives a copy of it instead, so no graph output aliases an input it did not alias before.
Contract: provides "collectives_of_one_dropped".
"""

from __future__ import annotations

import torch
from torch import fx

from fsdp2_compile.compiler.pass_api import Fact, PassContext, contract
from fsdp2_compile.core.fx_edit import insert_call, tags_of
from fsdp2_compile.core.ir import WAIT, CollectiveArgs, collective_kind


@contract(provides=(Fact.COLLECTIVES_OF_ONE_DROPPED,))
def drop_collectives_of_one(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    for node in list(graph.nodes):
        if collective_kind(node) is None:
            continue
        call = CollectiveArgs.of(node)
        if call.ranks() != 1 or any(user.target is not WAIT for user in node.users):
            continue
        x = call.input
        if x.op == "placeholder":
            with graph.inserting_before(node):
                x = insert_call(graph, torch.ops.aten.clone.default, (x,), tags_of(node))
        for wait in list(node.users):
            wait.replace_all_uses_with(x)
            graph.erase_node(wait)
        graph.erase_node(node)
    return gm
