"""`reshard_after_forward=int` (FSDP2's meaning): after forward each rank keeps 1/k of every gathered parameter
of the module instead of 1/N, and backward all-gathers it from the k ranks of a smaller group (consecutive ranks
of the shard group, e.g. the GPUs of one node) instead of from all N. Gradients are still reduce-scattered over
the whole group, so the numerics are those of `reshard_after_forward=True`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx

from fsdp2_compile._torch_private import group_ranks
from fsdp2_compile.core.fx_edit import insert_call, nodes_calling, val
from fsdp2_compile.core.ir import UNSHARD, UnshardArgs
from fsdp2_compile.core.ops import padded_rows

__all__ = ["gather_backward_from_post_forward_shards"]


# `shard` resolves the setting and creates the smaller groups (`process_groups.resolve_reshard`). The compiled graphs get it after
# torch's partitioner (`gather_backward_from_post_forward_shards`): the partitioner made backward gather each
# resharded parameter again from its shard; the rewrite makes forward save this rank's 1/k rows of the gathered
# parameter (one more saved tensor, like an activation) and backward gather those over the smaller group instead.
# Uncompiled (eager) runs gather from the whole group in backward.
def gather_backward_from_post_forward_shards(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """For each parameter with a post-forward group that backward gathers again: forward saves this rank's rows of
    its gathered value (after the user outputs, before the other saved values), and backward's `fsdp2::unshard`
    gathers those rows (a new first input) over the post-forward group. Both graphs are changed in place."""
    gathered = {}
    for node in nodes_calling(fw.graph, UNSHARD):
        gathered.setdefault(UnshardArgs.of(node).fqn, node)
    saved, first_input = [], next(iter(bw.graph.find_nodes(op="placeholder")))
    for node in nodes_calling(bw.graph, UNSHARD):
        call = UnshardArgs.of(node)
        if not call.post_forward_size or call.fqn not in gathered:
            continue
        size = call.post_forward_size
        rows = padded_rows(call.dim0, size)
        start = min(group_ranks(call.post_forward_group_name).index(dist.get_rank()) * rows, call.dim0)
        full = gathered[call.fqn]
        with fw.graph.inserting_after(full):
            part = insert_call(fw.graph, torch.ops.aten.slice.Tensor, (full, 0, start, min(start + rows, call.dim0)))
        with fw.graph.inserting_after(part):
            saved.append(insert_call(fw.graph, torch.ops.aten.clone.default, (part,)))
        with bw.graph.inserting_before(first_input):
            rows_in = bw.graph.placeholder(f"post_forward_{len(saved)}")
        rows_in.meta["val"] = val(saved[-1])
        regather = call.replace(
            shard=rows_in,
            world_size=size,
            group_name=call.post_forward_group_name,
            param_dtype=None,
            post_forward_size=0,
            post_forward_group_name="",
        )
        node.args, node.kwargs = regather.as_args(), {}
    if not saved:
        return
    output = fw.graph.output_node()
    [outs] = output.args
    output.args = ((*outs[:num_fwd_outputs], *saved, *outs[num_fwd_outputs:]),)
    fw.recompile()
    bw.recompile()
