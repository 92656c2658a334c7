"""Tag the collectives that are in the graph before any FSDP lowering — tensor parallelism's, from DTensor
redistribution — and their waits with `Role.TP`, so that reports and dumps tell them from FSDP's. The FSDP passes
only move collectives tagged with their own kind (`ir.fsdp_collective_kind`); the cost model and the rank
consistency check count every collective. Contract: provides "tp_tagged".
"""

from __future__ import annotations

from torch import fx

from fsdp2_compile.compiler.pass_api import Fact, PassContext, contract
from fsdp2_compile.core.ir import ROLE, WAIT, Role, collective_kind


@contract(provides=(Fact.TP_TAGGED,))
def tag_tp_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        if collective_kind(node) is not None and ROLE not in node.meta:
            node.meta[ROLE] = Role.TP
            for wait in (u for u in node.users if u.target is WAIT):
                wait.meta[ROLE] = Role.TP
    return gm
