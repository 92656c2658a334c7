"""The pass pipeline: one ordered list, run on every graph the backend (or the CLI) produces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

from .config import CompileConfig
from .cost_model import PROFILES, HardwareProfile, Timeline, concrete
from .graph import BUCKET, PARAMS, ROLE
from .invariants import check_collectives_safe
from .passes import (
    bucket_collectives,
    combine_tied_grads,
    keep_inputs_until_wait,
    lower_reduce_grad,
    lower_unshard,
    reorder_for_overlap,
    schedule,
)
from .report import collective

__all__ = ["PASSES", "NodeFacts", "PassContext", "Snapshot", "node_facts", "run_pipeline"]

_WAIT = torch.ops._c10d_functional.wait_tensor.default


@dataclass(frozen=True)
class NodeFacts:
    """One fsdp node of a snapshot: its role (`graph.ROLE`; else the collective kind, "wait" or the fsdp2 op
    name), the parameters and bucket it serves, and its tensor's dtype and bytes (a collective's: the full buffer,
    as `report.collective` counts it; None when not a tensor)."""

    role: str | None
    params: tuple[str, ...]
    bucket: str
    dtype: torch.dtype | None = None
    nbytes: int | None = None


@dataclass(frozen=True)
class Snapshot:
    """The graph after one pass: its text and the facts of its fsdp nodes, by node name."""

    name: str
    text: str
    nodes: dict[str, NodeFacts]


def node_facts(node: fx.Node) -> NodeFacts | None:
    """The facts of a node the passes tagged, a collective or wait, or an fsdp2 custom op; else None."""
    op = node.target._opname if getattr(node.target, "namespace", None) == "fsdp2" else None
    found, is_wait = collective(node), node.target is _WAIT
    if op in ("unshard", "reduce_grad"):
        params, bucket = (node.args[6],), node.args[7]
    elif op in ("stash_grad", "add_pending_grad"):
        params, bucket = (node.args[1].partition("@")[0],), ""  # pending_key: "<fqn>@<id>"
    elif ROLE in node.meta or found is not None or is_wait:
        params, bucket = tuple(node.meta.get(PARAMS, ())), node.meta.get(BUCKET, "")
    else:
        return None
    role = node.meta.get(ROLE) or op or (found.kind if found is not None else "wait" if is_wait else None)
    value = node.meta.get("val")
    if found is not None:
        return NodeFacts(role, params, bucket, found.dtype, found.nbytes)
    if isinstance(value, torch.Tensor):
        return NodeFacts(role, params, bucket, value.dtype, int(concrete(value.numel())) * value.element_size())
    return NodeFacts(role, params, bucket)


def snapshot(name: str, gm: fx.GraphModule) -> Snapshot:
    """`gm`'s graph after pass `name`."""
    facts = {n.name: node_facts(n) for n in gm.graph.nodes}
    return Snapshot(name, str(gm.graph), {k: v for k, v in facts.items() if v is not None})


@dataclass
class PassContext:
    """What a pass may know besides the graph."""

    kind: str
    """Which graph this is: "forward", "backward" or "inference"."""
    config: CompileConfig = field(default_factory=CompileConfig)
    profile: HardwareProfile = PROFILES["cpu-gloo-loopback"]
    """The cost model's hardware figures (the backend passes the agreed measured or named profile)."""
    timeline: Timeline | None = None
    """The simulated step of the final order, left by `schedule`."""
    snapshots: list[Snapshot] = field(default_factory=list)
    """The graph after every pass, for dumps."""


Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

PASSES: list[Pass] = [
    combine_tied_grads,
    lower_unshard,
    lower_reduce_grad,
    bucket_collectives,
    reorder_for_overlap,
    schedule,
    keep_inputs_until_wait,
]


def run_pipeline(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Run every pass in order; each leaves a graph that still lints and recompiles. The result must pass
    `invariants.check_collectives_safe`."""
    ctx.snapshots.append(snapshot("captured", gm))
    for p in PASSES:
        gm = p(gm, ctx)
        gm.graph.lint()
        gm.recompile()
        ctx.snapshots.append(snapshot(p.__name__, gm))
    check_collectives_safe(gm)
    return gm
