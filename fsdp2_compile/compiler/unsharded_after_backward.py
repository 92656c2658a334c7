"""`set_reshard_after_backward(False)` (FSDP2's meaning): parameters stay gathered after backward, so the next
forward gathers nothing — gradient accumulation trading memory for communication.
"""

from __future__ import annotations

from torch import fx

from fsdp2_compile.core.fx_edit import insert_op, nodes_calling
from fsdp2_compile.core.ir import UNSHARD, KeepUnshardedArgs, Tags, UnshardArgs

__all__ = ["keep_unsharded_after_backward"]


# After torch's partitioner, `keep_unsharded_after_backward` adds `fsdp2::keep_unsharded(full, key)` where each such
# parameter is gathered last: in backward where backward gathers it again, else (kept from forward to backward) in
# forward. The next forward's trace sees the kept tensor (`ParamInfo.gather` passes it to `fsdp2::unshard` as
# `gathered`; Dynamo guards on it, so forwards with and without kept parameters are two graphs), and `lower_unshard`
# turns that unshard into the tensor itself plus `fsdp2::release_unsharded(key)`. Kept parameters are dropped when
# an optimizer holding them steps (they would be stale; FSDP2 leaves that to the user: `param_state.drop_kept_of`,
# run by the step pre-hook `shard` registers while sharded modules live) and by `FSDPModule.reshard()`.
def keep_unsharded_after_backward(fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    """Insert `fsdp2::keep_unsharded` after the last gather of each parameter whose module set
    `reshard_after_backward` off (and that the next forward will not be given already kept)."""
    kept: set[str] = set()
    for graph, gm in ((bw.graph, bw), (fw.graph, fw)):  # backward first: its gather is the last one
        changed = False
        for node in nodes_calling(graph, UNSHARD):
            call = UnshardArgs.of(node)
            if call.reshard_after_backward or call.fqn in kept:
                continue
            kept.add(call.fqn)
            with graph.inserting_after(node):
                insert_op(graph, KeepUnshardedArgs(node, call.kept_key), Tags((call.fqn,), call.bucket).meta())
            changed = True
        if changed:
            gm.recompile()
