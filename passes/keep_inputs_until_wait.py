"""Keep every collective's inputs alive until its wait: after each `wait_tensor`, insert
`fsdp2::keep_alive([waited, *inputs])`.

Why: the generated Python frees a value right after its last use (`x = None`), and for a collective that use is
the call that *starts* it. Whether the backend still reads (or writes) the input afterwards is the backend's
business: gloo's all-gather reads its input on a worker thread after the call returned, NCCL on its stream. An
input freed early is a use-after-free whose memory the allocator hands to the next tensor. Inductor models the
same rule itself ("Out-of-Place Collective Safety": a wait reads its collective's inputs); this pass makes the
FX graph say it too, whatever order the scheduler chose. The keep-alive also takes the waited value, so it can
only ever sit after the wait. `invariants.check_collectives_safe` verifies the result.

Contract: requires "ordered" (the final order: runs last); provides "collectives_safe": a `keep_alive` node
(`Role.KEEP_ALIVE`) after every wait of a collective.
"""

from __future__ import annotations

import torch
from torch import fx

from fsdp2_compile.compiler.pass_api import Fact, PassContext, contract
from fsdp2_compile.core.ir import KEEP_ALIVE, ROLE, WAIT, KeepAliveArgs, Role, collective_kind


@contract(requires=(Fact.ORDERED,), provides=(Fact.COLLECTIVES_SAFE,))
def keep_inputs_until_wait(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    for node in [n for n in graph.nodes if collective_kind(n) is not None]:
        inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        for wait in [u for u in node.users if u.target is WAIT]:
            with graph.inserting_after(wait):
                keep = graph.call_function(KEEP_ALIVE, KeepAliveArgs([wait, *inputs]).as_args())
            keep.meta.update({ROLE: Role.KEEP_ALIVE, "val": None})
    return gm
