"""Gradient sync read when backward runs, as FSDP2 reads it.

A compiled forward fixes its backward's reductions when Dynamo traces it (each parameter's
`ParamSpec.requires_grad_sync`), but FSDP2 reads `set_requires_gradient_sync` when the backward runs, and torch's
pipeline schedules set it between a micro-batch's forward and its backward. So the backward compiler keeps a copy of
the backward graph as partitioned, and a backward run while some parameters' flags differ from the traced ones runs
a variant of it in which those parameters' gradients are kept unsharded (`fsdp2::stash_grad`) instead of reduced,
or reduced (what was kept added first) instead of kept. Each variant is compiled once, at its first run, through the
same pass pipeline; ranks that set the flags alike run the same variant.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import fx

from fsdp2_compile._torch_private import current_compile_context, in_compile_context
from fsdp2_compile.core.fx_edit import insert_call, nodes_calling, tags_of, val
from fsdp2_compile.core.ir import (
    ADD_PENDING_GRAD,
    REDUCE_GRAD,
    STASH_GRAD,
    AddPendingGradArgs,
    ReduceGradArgs,
    StashGradArgs,
)
from fsdp2_compile.core.ops import backward_facts, shard_grad
from fsdp2_compile.runtime.param_state import ParamInfo

__all__ = ["BackwardBySync"]


def _traced_sync(gm: fx.GraphModule) -> dict[str, bool]:
    """fqn -> whether `gm` reduces the parameter's gradient (True) or keeps it unsharded (False)."""
    traced = {ReduceGradArgs.of(n).fqn: True for n in nodes_calling(gm.graph, REDUCE_GRAD)}
    traced.update({StashGradArgs.of(n).fqn: False for n in nodes_calling(gm.graph, STASH_GRAD)})
    return traced


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose graph the passes can change without changing `gm`'s (nodes and their meta copied,
    tensors and modules shared)."""
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    copied.meta.update(gm.meta)
    return copied


def _flip(gm: fx.GraphModule, infos: dict[str, ParamInfo], flipped: frozenset[str]) -> None:
    """Reduce what `gm` keeps and keep what it reduces, for the parameters named in `flipped`, as their infos say."""
    graph = gm.graph
    for node in list(nodes_calling(graph, REDUCE_GRAD)):
        a = ReduceGradArgs.of(node)
        if a.fqn not in flipped:
            continue
        grad, pending = a.grad, None
        if isinstance(grad, fx.Node) and grad.target is ADD_PENDING_GRAD:
            pending, grad = grad, AddPendingGradArgs.of(grad).grad
        info = infos[a.fqn]
        with graph.inserting_before(node):
            args = (grad, info.pending_key, a.reduce_dtype, a.local_rows, a.out_dtype, a.fqn)
            kept = insert_call(graph, STASH_GRAD, args, tags_of(node))
        node.replace_all_uses_with(kept)
        graph.erase_node(node)
        if pending is not None and not pending.users:
            graph.erase_node(pending)
    for node in list(nodes_calling(graph, STASH_GRAD)):
        a = StashGradArgs.of(node)
        if a.fqn not in flipped:
            continue
        shard = val(node)  # the zero shard it returns: the shard's rows, dtype and device
        spec = infos[a.fqn].spec()
        facts = backward_facts(spec, shard, 4)
        with graph.inserting_before(node):
            tags = tags_of(node)
            reduced = shard_grad(facts, a.grad, lambda op, *args, tags=tags: insert_call(graph, op, args, tags))
        node.replace_all_uses_with(reduced)
        graph.erase_node(node)
    graph.lint()


class BackwardBySync:
    """A compiled backward that honours the gradient-sync flags of its parameters when it runs (boxed, as
    AOTAutograd calls it). Made from the backward graph before the passes (`gm`, which it copies, then compiles
    with `compile_graph` (or `compile_traced`), as each variant later with `compile_graph`); `infos`: the graph's
    parameters by fqn."""

    def __init__(
        self,
        gm: fx.GraphModule,
        compile_graph: Callable[[fx.GraphModule], Callable],
        infos: dict[str, ParamInfo],
        compile_traced: Callable[[fx.GraphModule], Callable] | None = None,
    ):
        self._original, self._compile, self._infos = _copy(gm), compile_graph, infos
        self._context = current_compile_context()  # variants compile as part of it: the same id on every rank
        self._traced = {fqn: sync for fqn, sync in _traced_sync(gm).items() if fqn in infos}
        self._variants: dict[frozenset[str], Callable] = {frozenset(): (compile_traced or compile_graph)(gm)}

    def __call__(self, args: list):
        flipped = frozenset(f for f, sync in self._traced.items() if self._infos[f].requires_gradient_sync != sync)
        if flipped not in self._variants:
            self._check_flippable(flipped)
            variant = _copy(self._original)
            _flip(variant, self._infos, flipped)
            with in_compile_context(self._context):
                self._variants[flipped] = self._compile(variant)
        return self._variants[flipped](args)

    def _check_flippable(self, flipped: frozenset[str]) -> None:
        for fqn in sorted(flipped):
            if self._infos[fqn].grad_key:
                raise RuntimeError(
                    f"fsdp2_compile: parameter '{fqn}' has post-accumulate-grad hooks (optimizer in backward) and its "
                    "gradient sync was changed between the forward and this backward; call "
                    "set_requires_gradient_sync before the forward"
                )
