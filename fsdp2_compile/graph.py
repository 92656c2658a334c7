"""Small helpers every pass shares: the `node.meta` keys passes leave for each other, and node insertion that
keeps `meta["val"]` (a fake tensor) correct so later passes can read shapes and dtypes."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import fx

from ._torch_private import detect_fake_mode

__all__ = ["PARAM_FQN", "ROLE", "insert_call", "insert_contiguous", "nodes_calling", "val"]

PARAM_FQN = "fsdp.param_fqn"
"""The parameter a communication/cast node belongs to."""
ROLE = "fsdp.role"
"""What a lowered node does: "cast", "pad", "all_gather", "reduce_scatter", "wait", "unpad", "contiguous"."""


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
