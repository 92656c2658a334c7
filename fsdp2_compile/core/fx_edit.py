"""Small graph helpers every pass shares: node insertion that keeps `meta["val"]` (a fake tensor) correct so later
passes can read shapes and dtypes, positions and a stable topological sort. The graph's contract
(the `node.meta` keys, roles, argument views, byte counts) is `ir.py`'s; its keys are re-exported here."""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from fsdp2_compile._torch_private import detect_fake_mode, fake_output_by_meta_kernel, tree_leaves
from fsdp2_compile._torch_private import functional_collectives as _c10d
from fsdp2_compile.core.ir import BUCKET, PARAMS, REDUCE_GRAD, ROLE, UNSHARD, OpArgs, ReduceGradArgs, UnshardArgs, val

__all__ = [
    "BUCKET",
    "PARAMS",
    "ROLE",
    "VIEW_OPS",
    "ancestors_after",
    "insert_call",
    "insert_contiguous",
    "insert_op",
    "nodes_calling",
    "positions",
    "stable_topological_sort",
    "val",
]

VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "slice",
        "t",
        "transpose",
        "permute",
        "expand",
        "alias",
        "select",
        "split",
        "split_with_sizes",
        "unsqueeze",
        "squeeze",
        "as_strided",
        "detach",
        "unbind",
        "reshape",
    }
)
"""Aten ops, by overload packet name, whose outputs share their input's storage: no compute, no memory traffic."""


def nodes_calling(graph: fx.Graph, target: Any) -> list[fx.Node]:
    """All call_function nodes of `graph` whose target is `target` (an OpOverload), in graph order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def _gathered(x: torch.Tensor, group_size: int, *_) -> torch.Tensor:
    size = list(x.shape) or [1]
    size[0] *= group_size
    return x.new_empty(size)


def _scattered(x: torch.Tensor, op: str, group_size: int, *_) -> torch.Tensor:
    return x.new_empty((x.shape[0] // group_size, *x.shape[1:]))


def _reduced(grad: torch.Tensor, *args, **kwargs) -> torch.Tensor | None:
    """`fsdp2::reduce_grad`'s shard on the gradient's device; None (the op's own fake) where it names a device of
    its own (`CPUOffloadPolicy`)."""
    a = ReduceGradArgs.bind((grad, *args), kwargs)
    if a.out_device is not None:
        return None
    return grad.new_empty((a.local_rows, *grad.shape[1:]), dtype=a.out_dtype)


_aten = torch.ops.aten
_META_OUTPUTS: dict[Any, Callable[..., torch.Tensor]] = {
    _c10d.all_gather_into_tensor.default: _gathered,
    _c10d.reduce_scatter_tensor.default: _scattered,
    _c10d.wait_tensor.default: torch.empty_like,
    **{
        op: op
        for op in (
            _aten.view.default,
            _aten.slice.Tensor,
            _aten.clone.default,
            _aten.cat.default,
            _aten.constant_pad_nd.default,
            _aten.mul.Tensor,
            _aten.div.Tensor,
            torch.ops.prims.convert_element_type.default,
        )
    },
    REDUCE_GRAD: _reduced,
}
"""What the passes insert most (collectives, bucketing's copy-in / copy-out views, the casts, pads and scalings
of a gradient's reduction, the reduction itself before it is lowered), thousands of nodes in a large graph: their
fake outputs are made by these functions on the meta kernels (`fake_output_by_meta_kernel`), as the fake mode
would make them but without its per-call dispatch (a fifth of the time); other ops run under the mode."""


_OWN_META = ("val", "eager_input_vals")
"""What a node's meta says of its own output and arguments: not carried over to a node replacing it."""


def tags_of(node: fx.Node) -> dict[str, Any]:
    """`node`'s meta for a node that replaces it (another op): its tags, not its value or argument values (Inductor
    checks a call's arguments against `eager_input_vals`)."""
    return {k: v for k, v in node.meta.items() if k not in _OWN_META}


def insert_call(
    graph: fx.Graph, target: Any, args: tuple, meta: dict[str, Any] | None = None, kwargs: dict[str, Any] | None = None
) -> fx.Node:
    """Insert `target(*args, **kwargs)` at the graph's current insertion point, its fake value in meta["val"]."""
    node = graph.call_function(target, args, kwargs)
    fake_args, kwargs = fx.node.map_arg(args, val), kwargs or {}
    out = fake_output_by_meta_kernel(_META_OUTPUTS[target], fake_args, kwargs) if target in _META_OUTPUTS else None
    if out is None:
        with detect_fake_mode(tree_leaves(fake_args)) or contextlib.nullcontext():
            out = target(*fake_args, **kwargs)
    node.meta["val"] = out
    node.meta.update(meta or {})
    return node


def insert_op(graph: fx.Graph, call: OpArgs, meta: dict[str, Any] | None = None) -> fx.Node:
    """Insert the call a named argument view describes (e.g. `AllGatherArgs(input=x, group_size=n, group_name=g)`)."""
    return insert_call(graph, call.op, call.as_args(), meta)


def insert_contiguous(graph: fx.Graph, node: fx.Node, meta: dict[str, Any]) -> fx.Node:
    """`node` itself when its value is contiguous, else a contiguous copy (collectives need dense inputs)."""
    if val(node).is_contiguous():
        return node
    return insert_call(graph, torch.ops.aten.clone.default, (node,), meta, {"memory_format": torch.contiguous_format})


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's index in the graph's current order."""
    return {n: i for i, n in enumerate(graph.nodes)}


def ancestors_after(node: fx.Node, position: int, pos: dict[fx.Node, int]) -> list[fx.Node]:
    """`node` and its ancestors that come at or after `position`, in graph order."""
    found, stack = {node}, [node]
    while stack:
        for producer in stack.pop().all_input_nodes:
            if pos[producer] >= position and producer not in found:
                found.add(producer)
                stack.append(producer)
    return sorted(found, key=pos.__getitem__)


def stable_topological_sort(gm: fx.GraphModule, key: Callable[[fx.Node], tuple] | None = None) -> None:
    """Reorder `gm.graph` in place into a topological order that, among the nodes ready at each point, takes the one
    with the smallest `key` (a tuple; default: its current position), ties by current position. Placeholders stay
    first, in order; the output node stays last. Deterministic. Nodes are moved, not copied."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    pos = {n: i for i, n in enumerate(nodes)}

    def entry(node: fx.Node) -> tuple:
        if node.op == "placeholder":
            return (False, (), pos[node])
        return (True, key(node) if key is not None else (pos[node],), pos[node])

    missing = {n: len(n.all_input_nodes) for n in nodes}
    ready = [entry(n) for n in nodes if not missing[n]]
    heapq.heapify(ready)
    previous, placed = None, 0
    while ready:
        node = nodes[heapq.heappop(ready)[-1]]
        placed += 1
        if previous is None:
            first = next(iter(gm.graph.nodes))
            if first is not node:
                first.prepend(node)
        elif previous.next is not node:
            previous.append(node)
        previous = node
        for user in node.users:
            if user in missing:
                missing[user] -= 1
                if not missing[user]:
                    heapq.heappush(ready, entry(user))
    if placed != len(nodes):
        raise RuntimeError(f"fsdp2_compile: the graph has a dependency cycle ({len(nodes) - placed} nodes never ready)")


def fold_repeated_unshards(graph: fx.Graph, which: Callable[[UnshardArgs], bool] = lambda call: True) -> None:
    """One `fsdp2::unshard` per parameter (among the calls `which` accepts): a later call with the same static
    arguments (fqn included: they identify the parameter) is replaced by the first, and the view of the shard it
    read goes too when nothing else reads it."""
    first: dict[tuple, fx.Node] = {}
    for node in list(graph.find_nodes(op="call_function", target=UNSHARD)):
        call = UnshardArgs.of(node)
        if not which(call):
            continue
        key = call.static()
        if key not in first:
            first[key] = node
            continue
        node.replace_all_uses_with(first[key])
        graph.erase_node(node)
        shard = call.shard
        if isinstance(shard, fx.Node) and shard.op != "placeholder" and not shard.users:
            graph.erase_node(shard)
