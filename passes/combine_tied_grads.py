"""Sum the gradients of a parameter used several times (tied weights) *before* reducing them.

Rewrites `add(reduce_grad(a, *args), reduce_grad(b, *args))` — looking through shape-preserving views of the
reductions — into `reduce_grad(add(a, b), *args)` until no such pair is left, so a tied parameter gets one
reduce-scatter, as in FSDP2 (where autograd accumulates before the reduction). Valid because the averaging
reduce-scatter is linear. When both reductions first add the gradient kept from unsynced micro-batches
(`fsdp2::add_pending_grad`, same parameter), the uses are summed before that one add: `kept + (a + b)`, FSDP2's
order (autograd sums the uses, then accumulates into the kept `.grad`), not `(kept + a) + b`. Gradients kept
unsynced (`fsdp2::stash_grad`, whose zero shards are added) are summed the same way before the one stash, so that
what is kept is `kept + (a + b)` there too. With torch 2.15's FSDP2, which gives the gathered parameter the
reduce dtype as its gradient dtype, a tied parameter computed in its own dtype and reduced in a narrower one gets
each use's gradient cast before the sum (what 2.15's `fully_shard` computes; wider reduce dtypes sum first).
Contract: provides "tied_grads_combined", which `lower_reduce_grad` requires (it needs the un-lowered `fsdp2::reduce_grad` nodes).
"""

from __future__ import annotations

import torch
from torch import fx

from fsdp2_compile._torch_private import grads_summed_in_reduce_dtype, unsafe_view
from fsdp2_compile.compiler.pass_api import Fact, PassContext, contract
from fsdp2_compile.core.fx_edit import insert_call, insert_op, nodes_calling, val
from fsdp2_compile.core.ir import (
    ADD_PENDING_GRAD,
    REDUCE_GRAD,
    STASH_GRAD,
    AddPendingGradArgs,
    ReduceGradArgs,
    StashGradArgs,
    schema_args,
)

aten, prims = torch.ops.aten, torch.ops.prims
_IDENTITY_VIEWS = (aten.view.default, aten.alias.default, unsafe_view.default)


_VIEWS = {REDUCE_GRAD: ReduceGradArgs, STASH_GRAD: StashGradArgs}


def _reduction_chain(node: object) -> list[fx.Node] | None:
    """[reduce_grad or stash_grad, *views] when `node` is a single-use reduce_grad or stash_grad seen through
    same-shape views, else None."""
    chain = []
    while isinstance(node, fx.Node) and len(node.users) == 1:
        chain.append(node)
        if node.target in _VIEWS:
            return chain[::-1]
        if node.target not in _IDENTITY_VIEWS:
            return None
        source = schema_args(node)["self"]  # the viewed tensor
        if val(node).shape != val(source).shape:
            return None
        node = source
    return None


def _pending_adds(a: object, b: object) -> tuple[AddPendingGradArgs, AddPendingGradArgs] | None:
    """The argument views of `a` and `b` when both are single-use `fsdp2::add_pending_grad` calls for the same
    parameter, else None."""
    nodes = (a, b)
    if not all(isinstance(n, fx.Node) and n.target is ADD_PENDING_GRAD and len(n.users) == 1 for n in nodes):
        return None
    views = tuple(AddPendingGradArgs.of(n) for n in nodes)
    return views if views[0].static() == views[1].static() else None


@contract(provides=(Fact.TIED_GRADS_COMBINED,))
def combine_tied_grads(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    changed = True
    while changed:
        changed = False
        for add in nodes_calling(graph, aten.add.Tensor):
            if len(add.args) != 2 or add.kwargs:
                continue
            chains = [_reduction_chain(a) for a in add.args]
            if None in chains or chains[0][0].target is not chains[1][0].target:
                continue
            view = _VIEWS[chains[0][0].target]
            first, second = view.of(chains[0][0]), view.of(chains[1][0])
            if first.static() != second.static():  # not the same parameter
                continue
            pending = _pending_adds(first.grad, second.grad) if view is ReduceGradArgs else None
            grads = (first.grad, second.grad) if pending is None else tuple(p.grad for p in pending)
            with graph.inserting_before(add):
                own, reduced = first.out_dtype, first.reduce_dtype  # the parameter's dtype, the reduction's
                narrower = reduced.itemsize < own.itemsize
                if grads_summed_in_reduce_dtype and narrower and all(val(g).dtype == own for g in grads):
                    grads = tuple(
                        insert_call(graph, prims.convert_element_type.default, (g, first.reduce_dtype)) for g in grads
                    )
                summed = insert_call(graph, aten.add.Tensor, grads)
                if pending is not None:
                    summed = insert_op(graph, pending[0].replace(grad=summed))
                reduced = insert_op(graph, first.replace(grad=summed))
            add.replace_all_uses_with(reduced)
            graph.erase_node(add)
            for chain in chains:
                for n in reversed(chain):
                    graph.erase_node(n)
            if pending is not None:
                graph.erase_node(first.grad)
                graph.erase_node(second.grad)
            changed = True
    return gm
