"""`reshard_after_forward=int` (FSDP2's meaning): after forward each rank keeps 1/k of every gathered parameter
of the module instead of 1/N, and backward all-gathers it from the k ranks of a smaller group (consecutive ranks
of the shard group, e.g. the GPUs of one node) instead of from all N. Gradients are still reduce-scattered over
the whole group, so the numerics are those of `reshard_after_forward=True`.

`shard` resolves the setting and creates the smaller groups (`resolve_reshard`). The compiled graphs get it after
torch's partitioner (`gather_backward_from_post_forward_shards`): the partitioner made backward gather each
resharded parameter again from its shard; the rewrite makes forward save this rank's 1/k rows of the gathered
parameter (one more saved tensor, like an activation) and backward gather those over the smaller group instead.
Uncompiled (eager) runs gather from the whole group in backward.
"""

from __future__ import annotations

import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import fx

from ._torch_private import group_ranks, group_timeout, one_thread_gloo_backend
from .comm_groups import dropped_with_groups
from .graph import insert_call, nodes_calling, val
from .ir import UNSHARD, UnshardArgs
from .ops import padded_rows

__all__ = ["gather_backward_from_post_forward_shards", "resolve_reshard"]

_GROUPS: dict[tuple[str, int], str] = dropped_with_groups({})
"""(shard group name, size) -> the name of this rank's post-forward group."""


def resolve_reshard(value: object, shard_group_name: str, shard_size: int) -> tuple[bool, int, str]:
    """(reshard after forward, post-forward group size or 0, its group name) for `shard(reshard_after_forward=
    value)`, as `fully_shard` reads it: None is True; an int k must divide the shard group's size N; k == N is
    True, k == 1 is False (with FSDP2's warning). Creates this rank's group of k (collective over its members)."""
    if value is None or isinstance(value, bool):
        return value is not False, 0, ""
    if not isinstance(value, int):
        raise TypeError(
            f"shard(reshard_after_forward={value!r}): use True, False, or an int that divides the shard group's "
            f"size {shard_size} (reshard to a group that small after forward)"
        )
    if not 1 <= value <= shard_size or shard_size % value:
        raise ValueError(
            f"shard(reshard_after_forward={value}): as an int it is the size of the group parameters are resharded "
            f"to after forward and must divide the shard group's size {shard_size}; use one of "
            f"{[k for k in range(1, shard_size + 1) if shard_size % k == 0]}, or True / False"
        )
    if value == 1:
        warnings.warn(
            "shard(reshard_after_forward=1) reshards parameters to world size 1, i.e. keeps them gathered until "
            "backward: the same as reshard_after_forward=False (use that)", stacklevel=3,
        )
        return False, 0, ""
    if value == shard_size:
        return True, 0, ""
    return True, value, _post_forward_group(shard_group_name, value)


def _post_forward_group(shard_group_name: str, size: int) -> str:
    """This rank's group of `size` consecutive ranks of the shard group (FSDP2's `mesh.view(-1, size)` rows); on
    gloo with one worker thread, like the FSDP groups of `comm_groups.py`."""
    key = (shard_group_name, size)
    if key not in _GROUPS:
        ranks = group_ranks(shard_group_name)
        start = ranks.index(dist.get_rank()) // size * size
        gloo = dist.get_backend(dist.group.WORLD) == "gloo"
        group = dist.new_group(
            ranks=ranks[start:start + size],
            backend=one_thread_gloo_backend() if gloo else None,
            timeout=timedelta(seconds=group_timeout(shard_group_name)),
            use_local_synchronization=True,
            group_desc=f"fsdp2_compile post-forward group of {size} in {shard_group_name}",
        )
        _GROUPS[key] = group.group_name
    return _GROUPS[key]


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
        regather = call.replace(shard=rows_in, world_size=size, group_name=call.post_forward_group_name,
                                param_dtype=None, post_forward_size=0, post_forward_group_name="")
        node.args, node.kwargs = regather.as_args(), {}
    if not saved:
        return
    output = fw.graph.output_node()
    [outs] = output.args
    output.args = ((*outs[:num_fwd_outputs], *saved, *outs[num_fwd_outputs:]),)
    fw.recompile()
    bw.recompile()
