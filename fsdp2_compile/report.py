"""What the compiled graphs contain and how often they ran: collectives, their bytes, per graph and per step.

The backend records every graph it compiles here (`compiled_graphs()`), so tests, the demo and the CLI read the
collectives from the very graphs that run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import fx

from .cost_model import Timeline, concrete
from .graph import PARAMS, val

if TYPE_CHECKING:
    from .pipeline import Snapshot

__all__ = [
    "Collective",
    "CompileCounts",
    "GraphRecord",
    "clear_compiled_graphs",
    "collective",
    "collectives",
    "compile_counts",
    "compiled_graphs",
    "record_graph",
]

_funcol = torch.ops._c10d_functional
_KINDS = {
    _funcol.all_gather_into_tensor.default: "all_gather",
    _funcol.reduce_scatter_tensor.default: "reduce_scatter",
    _funcol.all_reduce.default: "all_reduce",
}


@dataclass(frozen=True)
class Collective:
    """One collective node: its kind, the parameters it serves, and the bytes of the full (padded) tensor it
    gathers or reduces — what crosses the wire per rank, up to the (N-1)/N factor of a ring."""

    kind: str
    params: tuple[str, ...]
    dtype: torch.dtype
    nbytes: int


def collective(node: fx.Node) -> Collective | None:
    """The collective `node` issues, or None when it is not a collective."""
    kind = _KINDS.get(node.target) if node.op == "call_function" else None
    if kind is None:
        return None
    full = val(node) if kind == "all_gather" else val(node.args[0])
    return Collective(kind, node.meta.get(PARAMS, ()), full.dtype, int(concrete(full.numel())) * full.element_size())


def collectives(gm: fx.GraphModule) -> list[Collective]:
    """The collectives of a graph, in graph order."""
    return [c for c in map(collective, gm.graph.nodes) if c is not None]


@dataclass
class GraphRecord:
    """A graph the backend compiled: which one ("forward", "backward", "inference"), the final module, its
    snapshot after every pass, and the scheduler's simulated timeline."""

    kind: str
    gm: fx.GraphModule
    snapshots: list[Snapshot] = field(default_factory=list)
    timeline: Timeline | None = None
    """The scheduler's simulated step for this graph."""
    compile_id: tuple[int, int] | None = None
    """Dynamo's (frame, attempt) this graph came from: each graph break's continuation is a new frame, each
    recompile (e.g. for a new input shape) a new attempt of its frame. None when compiled outside Dynamo."""

    def summary(self) -> Counter:
        return Counter(c.kind for c in collectives(self.gm))


_RECORDS: list[GraphRecord] = []


def record_graph(record: GraphRecord) -> GraphRecord:
    """Keep `record`."""
    _RECORDS.append(record)
    return record


def compiled_graphs() -> list[GraphRecord]:
    """Every graph compiled by the fsdp2 backend in this process, oldest first."""
    return list(_RECORDS)


def clear_compiled_graphs() -> None:
    _RECORDS.clear()


@dataclass(frozen=True)
class CompileCounts:
    """How many graphs the backend compiled, and why: subgraphs (graph breaks) or recompiles."""

    forward: int
    backward: int
    inference: int
    frames: int
    """Distinct Dynamo frames (subgraphs) among the forward and inference graphs: the first, plus one per graph-break
    continuation that ran (a data-dependent branch has one per branch taken)."""
    recompiles: int
    """Forward and inference graphs beyond the first of their frame (guards failed, e.g. a new input shape)."""


def compile_counts() -> CompileCounts:
    """Counts of `compiled_graphs()`. Each subgraph (Dynamo frame) of a model with graph breaks compiles one forward
    and one backward graph (one inference graph under no_grad); a recompile, e.g. for a new input shape, adds one
    more of each for its frame."""
    kinds = Counter(r.kind for r in _RECORDS)
    ids = [r.compile_id for r in _RECORDS if r.kind in ("forward", "inference") and r.compile_id is not None]
    frames = {frame for frame, _ in ids}
    attempts = {(frame, attempt) for frame, attempt in ids}
    return CompileCounts(
        forward=kinds["forward"],
        backward=kinds["backward"],
        inference=kinds["inference"],
        frames=len(frames),
        recompiles=len(attempts) - len(frames),
    )
