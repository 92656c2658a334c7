"""Sum the gradients of a parameter used several times (tied weights) *before* reducing them.

Rewrites `add(reduce_grad(a, *args), reduce_grad(b, *args))` into `reduce_grad(add(a, b), *args)`, until no such
pair is left, so a tied parameter gets one reduce-scatter, as in FSDP2. Valid because the averaging
reduce-scatter is linear. Needs: un-lowered `fsdp2::reduce_grad` nodes (run before `lower_reduce_grad`).
"""

from __future__ import annotations

import torch
from torch import fx

from fsdp2_compile.graph import insert_call, nodes_calling
from fsdp2_compile.ops import REDUCE_GRAD

_ADD = torch.ops.aten.add.Tensor


def _combinable(add: fx.Node) -> bool:
    if len(add.args) != 2 or add.kwargs:
        return False
    a, b = add.args
    return all(
        isinstance(n, fx.Node) and n.target is REDUCE_GRAD and len(n.users) == 1 for n in (a, b)
    ) and a.args[1:] == b.args[1:]


def combine_tied_grads(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    graph = gm.graph
    changed = True
    while changed:
        changed = False
        for add in nodes_calling(graph, _ADD):
            if not _combinable(add):
                continue
            first, second = add.args
            with graph.inserting_before(add):
                summed = insert_call(graph, _ADD, (first.args[0], second.args[0]))
                reduced = insert_call(graph, REDUCE_GRAD, (summed, *first.args[1:]))
            add.replace_all_uses_with(reduced)
            for n in (add, first, second):
                graph.erase_node(n)
            changed = True
    return gm
