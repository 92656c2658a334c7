"""The pass pipeline: one ordered list, run on every graph the backend (or the CLI) produces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx

from .config import CompileConfig
from .cost_model import PROFILES, HardwareProfile, Timeline
from .passes import (
    bucket_collectives,
    combine_tied_grads,
    lower_reduce_grad,
    lower_unshard,
    reorder_for_overlap,
    schedule,
)

__all__ = ["PassContext", "PASSES", "run_pipeline"]


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
    snapshots: list[tuple[str, str]] = field(default_factory=list)
    """(pass name, graph text) after every pass, for dumps."""


Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

PASSES: list[Pass] = [
    combine_tied_grads,
    lower_unshard,
    lower_reduce_grad,
    bucket_collectives,
    reorder_for_overlap,
    schedule,
]


def run_pipeline(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Run every pass in order; each leaves a graph that still lints and recompiles."""
    ctx.snapshots.append(("captured", str(gm.graph)))
    for p in PASSES:
        gm = p(gm, ctx)
        gm.graph.lint()
        gm.recompile()
        ctx.snapshots.append((p.__name__, str(gm.graph)))
    return gm
