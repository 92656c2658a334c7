"""What the compiled graphs contain: collectives, their bytes, per graph; the snapshots a dump shows.

The backend records every graph it compiles here (`compiled_graphs()`, the newest `MAX_RECORDS`; `compile_counts()`
counts all), so tests, the demo and the CLI read the collectives from the very graphs that run. Snapshots of the
graph after every pass are taken only when a dump is asked for (`dump_requested()`, `CompileConfig.keep_snapshots`).
No drawing code here: that is `dump.py`'s, imported only when a dump is written.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter, deque
from collections.abc import Hashable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import fx

from fsdp2_compile.compiler.cost_model import Timeline
from fsdp2_compile.core.hardware import HardwareProfile
from fsdp2_compile.core.ir import (
    BUCKET,
    PARAMS,
    ROLE,
    WAIT,
    AddPendingGradArgs,
    Collective,
    ReduceGradArgs,
    Role,
    StashGradArgs,
    UnshardArgs,
    collective,
    fsdp_op_name,
    nbytes,
)

if TYPE_CHECKING:
    from fsdp2_compile.compiler.selective_unshard import KeptGathered

__all__ = [
    "drop_records_of",
    "record_owner",
    "records_owned_by",
    "DUMP_ENV",
    "MAX_RECORDS",
    "Collective",
    "CompileCounts",
    "GraphRecord",
    "NodeFacts",
    "Snapshot",
    "UNWRITABLE_DUMP_FOLDERS",
    "clear_compiled_graphs",
    "collective",
    "collectives",
    "compile_counts",
    "compiled_graphs",
    "dump_requested",
    "node_facts",
    "is_tp",
    "record_graph",
    "saved_bytes",
    "snapshot",
]

DUMP_ENV = "FSDP2_COMPILE_DUMP"
"""Environment variable: a folder to write the debug artefacts of every compiled graph to (`dump.py`)."""


UNWRITABLE_DUMP_FOLDERS: set[str] = set()
"""$FSDP2_COMPILE_DUMP folders a dump failed to write to (`dump.dump_from_env` warned once; no more dumps there)."""


def dump_requested() -> bool:
    """True when $FSDP2_COMPILE_DUMP asks for debug artefacts (then every pass's snapshot is kept), unless writing
    to that folder already failed."""
    root = os.environ.get(DUMP_ENV)
    return bool(root) and root not in UNWRITABLE_DUMP_FOLDERS


def collectives(gm: fx.GraphModule) -> list[Collective]:
    """The collectives of a graph, in graph order."""
    return [c for c in map(collective, gm.graph.nodes) if c is not None]


def is_tp(node: fx.Node) -> bool:
    """A collective, or a wait, of tensor parallelism: tagged `Role.TP`, or (before the tag_tp_collectives pass) not
    tagged by any FSDP pass. FSDP's collectives and waits always carry their own role."""
    if collective(node) is None and node.target is not WAIT:
        return False
    return node.meta.get(ROLE) in (None, Role.TP)


def saved_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the tensors a forward graph returns that are not its inputs (outputs + saved for backward)."""
    total, seen = 0, set()
    for arg in fx.node.map_arg(gm.graph.output_node().args, lambda n: n) or ():
        for node in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(node, fx.Node) and node.op != "placeholder" and node not in seen:
                seen.add(node)
                total += nbytes(node.meta.get("val"))
    return total


# ---------------------------------------------------------------------------------------------- snapshots


@dataclass(frozen=True)
class NodeFacts:
    """One fsdp node of a snapshot: its role (`ir.ROLE`; else the collective kind, "wait" or the fsdp2 op
    name), the parameters and bucket it serves, and its tensor's dtype and bytes (a collective's: the full buffer,
    as `ir.collective` counts it; None when not a tensor)."""

    role: str | None
    params: tuple[str, ...]
    bucket: str
    dtype: torch.dtype | None = None
    nbytes: int | None = None
    kind: str | None = None
    """The op: a collective's kind ("all_gather", "reduce_scatter", "all_reduce") or "wait"; None for others."""
    tp: bool = False
    """A collective or wait of tensor parallelism (DTensor redistribution): `Role.TP`, or (before the
    tag_tp_collectives pass) a collective / wait no FSDP pass tagged. Never counted with FSDP's."""


@dataclass(frozen=True)
class Snapshot:
    """The graph after one pass: its text and the facts of its fsdp nodes, by node name."""

    name: str
    text: str
    nodes: dict[str, NodeFacts]


def node_facts(node: fx.Node) -> NodeFacts | None:
    """The facts of a node the passes tagged, a collective or wait, or an fsdp2 custom op; else None."""
    op = fsdp_op_name(node)
    found, is_wait = collective(node), node.target is WAIT
    if op == "unshard":
        call = UnshardArgs.of(node)
        params, bucket = (call.fqn,), call.bucket
    elif op == "reduce_grad":
        call = ReduceGradArgs.of(node)
        params, bucket = (call.fqn,), call.bucket
    elif op in ("stash_grad", "add_pending_grad"):
        params, bucket = ((StashGradArgs if op == "stash_grad" else AddPendingGradArgs).of(node).fqn,), ""
    elif ROLE in node.meta or found is not None or is_wait:
        params, bucket = tuple(node.meta.get(PARAMS, ())), node.meta.get(BUCKET, "")
    else:
        return None
    role = node.meta.get(ROLE) or op or (found.kind if found is not None else "wait" if is_wait else None)
    value = node.meta.get("val")
    kind = str(found.kind) if found is not None else "wait" if is_wait else None
    tp = kind is not None and node.meta.get(ROLE) in (None, Role.TP)
    if found is not None:
        return NodeFacts(role, params, bucket, found.dtype, found.nbytes, kind, tp)
    if isinstance(value, torch.Tensor):
        return NodeFacts(role, params, bucket, value.dtype, nbytes(value), kind, tp)
    return NodeFacts(role, params, bucket, kind=kind, tp=tp)


def snapshot(name: str, gm: fx.GraphModule) -> Snapshot:
    """`gm`'s graph after pass `name`."""
    facts = {n.name: node_facts(n) for n in gm.graph.nodes}
    return Snapshot(name, str(gm.graph), {k: v for k, v in facts.items() if v is not None})


# ---------------------------------------------------------------------------------------------- records


@dataclass
class GraphRecord:
    """A graph the backend compiled: which one ("forward", "backward", "inference"), the final module, its
    snapshot after every pass (only when a dump was asked for: `CompileConfig.keep_snapshots` or
    $FSDP2_COMPILE_DUMP; else empty), the scheduler's simulated timeline and the profile it used."""

    kind: str
    gm: fx.GraphModule
    snapshots: list[Snapshot] = field(default_factory=list)
    timeline: Timeline | None = None
    """The scheduler's simulated step for this graph."""
    compile_id: tuple[int, int] | None = None
    """Dynamo's (frame, attempt) this graph came from: each graph break's continuation is a new frame, each
    recompile (e.g. for a new input shape) a new attempt of its frame. None when compiled outside Dynamo."""
    profile: HardwareProfile | None = None
    """The cost-model profile the scheduler used (the agreed measured one, or the configured one)."""
    kept_gathered: KeptGathered | None = None
    """Selective unsharding's decision for this graph's compile (`keep_gathered.KeptGathered`), or None when
    `CompileConfig.keep_gathered` is None."""
    owner: int | None = None
    """The id of the module `shard_compile` compiled this graph for (`records_owned_by`); its records are dropped
    when it dies. None for a module compiled with `torch.compile(backend="fsdp2")`."""
    frame: Hashable | None = None
    """What its compilation counts as a frame of (`rank_consistency.compile_frame`): its Dynamo frame, or, for a
    module with a saved compile, the saved compile's (the ordinary compile it falls back to recompiles it)."""


MAX_RECORDS = 64
"""How many `GraphRecord`s are kept (the newest): a long run that recompiles keeps a bounded report.
`compile_counts()` counts every graph regardless."""

_RECORDS: deque[GraphRecord] = deque(maxlen=MAX_RECORDS)
_KINDS: Counter = Counter()
_ATTEMPTS: dict[Hashable, set[tuple[int, int]]] = {}
"""Frame -> the compilations (Dynamo's compile ids) of it that produced a forward or inference graph."""


def record_graph(record: GraphRecord) -> GraphRecord:
    """Keep `record` (dropping the oldest beyond `MAX_RECORDS`) and count it."""
    global _RECORDS
    if _RECORDS.maxlen != MAX_RECORDS:  # MAX_RECORDS was changed (tests)
        _RECORDS = deque(_RECORDS, maxlen=MAX_RECORDS)
    _RECORDS.append(record)
    _KINDS[record.kind] += 1
    if record.kind in ("forward", "inference") and record.compile_id is not None:
        frame = record.frame if record.frame is not None else record.compile_id[0]
        _ATTEMPTS.setdefault(frame, set()).add(record.compile_id)
    return record


_OWNER: ContextVar[int | None] = ContextVar("fsdp2_compile_record_owner", default=None)


@contextlib.contextmanager
def records_owned_by(owner: int) -> Iterator[None]:
    """Graphs whose compilation starts in this block are recorded as `owner`'s (the id of the module they are
    compiled for): `drop_records_of(owner)` forgets them."""
    token = _OWNER.set(owner)
    try:
        yield
    finally:
        _OWNER.reset(token)


def record_owner() -> int | None:
    """The owner of graphs compiled now (`records_owned_by`)."""
    return _OWNER.get()


def drop_records_of(owner: int) -> None:
    """Forget the records of the graphs compiled for `owner` (it died): their graphs are freed with them."""
    kept = [r for r in _RECORDS if r.owner != owner]
    _RECORDS.clear()
    _RECORDS.extend(kept)


def compiled_graphs() -> list[GraphRecord]:
    """The graphs compiled by the fsdp2 backend in this process, oldest first (the newest `MAX_RECORDS`)."""
    return list(_RECORDS)


def clear_compiled_graphs() -> None:
    _RECORDS.clear()
    _KINDS.clear()
    _ATTEMPTS.clear()


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
    return CompileCounts(
        forward=_KINDS["forward"],
        backward=_KINDS["backward"],
        inference=_KINDS["inference"],
        frames=len(_ATTEMPTS),
        recompiles=sum(len(attempts) - 1 for attempts in _ATTEMPTS.values()),
    )
