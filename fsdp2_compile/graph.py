"""Small helpers every pass shares: the `node.meta` keys passes leave for each other, and node insertion that
keeps `meta["val"]` (a fake tensor) correct so later passes can read shapes and dtypes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import networkx as nx
import torch
from torch import fx

from ._torch_private import detect_fake_mode

__all__ = [
    "BUCKET",
    "PARAMS",
    "ROLE",
    "ancestors_after",
    "dependency_graph",
    "insert_call",
    "insert_contiguous",
    "nodes_calling",
    "positions",
    "stable_topological_sort",
    "val",
]

PARAMS = "fsdp.params"
"""The parameter names (a tuple) a communication/cast/copy node serves; several once bucketed."""
BUCKET = "fsdp.bucket"
"""The FSDP group (module path of its `shard` call) a communication/cast node belongs to; bucketing may refine it."""
ROLE = "fsdp.role"
"""What a lowered node does: "cast", "pad", "contiguous", "copy_in", "all_gather", "reduce_scatter", "wait",
"copy_out", "unpad"."""


def val(node: Any) -> Any:
    """The fake value of a node (or the argument itself when it is not a node)."""
    return node.meta["val"] if isinstance(node, fx.Node) else node


def nodes_calling(graph: fx.Graph, target: Any) -> list[fx.Node]:
    """All call_function nodes of `graph` whose target is `target` (an OpOverload), in graph order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def insert_call(
    graph: fx.Graph, target: Any, args: tuple, meta: dict[str, Any] | None = None, kwargs: dict[str, Any] | None = None
) -> fx.Node:
    """Insert `target(*args, **kwargs)` at the graph's current insertion point, its fake value in meta["val"]."""
    node = graph.call_function(target, args, kwargs)
    fake_args = fx.node.map_arg(args, val)
    fake_mode = detect_fake_mode([a for a in fake_args if isinstance(a, torch.Tensor)])
    with fake_mode or contextlib.nullcontext():
        node.meta["val"] = target(*fake_args, **(kwargs or {}))
    node.meta.update(meta or {})
    return node


def insert_contiguous(graph: fx.Graph, node: fx.Node, meta: dict[str, Any]) -> fx.Node:
    """`node` itself when its value is contiguous, else a contiguous copy (collectives need dense inputs)."""
    if val(node).is_contiguous():
        return node
    return insert_call(graph, torch.ops.aten.clone.default, (node,), meta, {"memory_format": torch.contiguous_format})


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's index in the graph's current order."""
    return {n: i for i, n in enumerate(graph.nodes)}


def dependency_graph(graph: fx.Graph) -> nx.DiGraph:
    """The data dependencies of `graph` as a DAG (edge: producer -> consumer), output node excluded."""
    dag = nx.DiGraph()
    for node in graph.nodes:
        if node.op == "output":
            continue
        dag.add_node(node)
        for producer in node.all_input_nodes:
            dag.add_edge(producer, node)
    return dag


def ancestors_after(node: fx.Node, position: int, pos: dict[fx.Node, int]) -> list[fx.Node]:
    """`node` and its ancestors that come at or after `position`, in graph order."""
    found, stack = {node}, [node]
    while stack:
        for producer in stack.pop().all_input_nodes:
            if pos[producer] >= position and producer not in found:
                found.add(producer)
                stack.append(producer)
    return sorted(found, key=pos.__getitem__)


def stable_topological_sort(gm: fx.GraphModule, key: Callable[[fx.Node], float] | None = None) -> None:
    """Rebuild `gm.graph` in a topological order that, among the nodes ready at each point, takes the one with the
    smallest `key` (default: its current position). Placeholders stay first, in order. Deterministic.
    Node objects are replaced (meta is kept): look nodes up again afterwards."""
    pos = positions(gm.graph)

    def sort_key(node: fx.Node) -> tuple[float, int]:
        if node.op == "placeholder":
            return (float("-inf"), pos[node])
        return (key(node) if key is not None else pos[node], pos[node])

    new = fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
    env: dict[fx.Node, fx.Node] = {}
    for node in nx.lexicographical_topological_sort(dependency_graph(gm.graph), key=sort_key):
        env[node] = new.node_copy(node, env.__getitem__)
    new.node_copy(gm.graph.output_node(), env.__getitem__)
    gm.graph = new
