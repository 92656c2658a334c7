"""The cost model every scheduling decision and every estimate uses (one model for the scheduler, the CLI and the
planner): collectives by an alpha-beta model, compute from FLOPs and bytes of each node's shapes.

`simulate(gm, profile)` plays a graph in its order on one compute lane and one communication lane (collectives run
in issue order, a wait blocks compute until its collective ends) and returns the timeline, the exposed
communication and the live bytes over the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx
from torch.utils.flop_counter import flop_registry

from fsdp2_compile._torch_private import OpOverload
from fsdp2_compile.core.fx_edit import VIEW_OPS
from fsdp2_compile.core.hardware import HardwareProfile
from fsdp2_compile.core.ir import (
    KEEP_ALIVE,
    WAIT,
    CollectiveArgs,
    Role,
    SubgraphCall,
    WaitArgs,
    collective_kind,
    concrete,
    nbytes,
)

__all__ = [
    "Event",
    "Timeline",
    "concrete",
    "node_time",
    "simulate",
]


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def collective_time(node: fx.Node, profile: HardwareProfile) -> float:
    """alpha + (N-1)/N * bytes * beta (an all-reduce, a reduce-scatter plus an all-gather, counts twice that)."""
    call, kind = CollectiveArgs.of(node), collective_kind(node)
    world = call.ranks()
    if kind == Role.ALL_REDUCE:
        return profile.alpha_s + 2 * (world - 1) / world * nbytes(_val(call.input)) * profile.beta_s_per_byte
    full = _val(node) if kind == Role.ALL_GATHER else _val(call.input)
    return profile.alpha_s + (world - 1) / world * nbytes(full) * profile.beta_s_per_byte


def compute_time(node: fx.Node, profile: HardwareProfile) -> float:
    call = SubgraphCall.of(node)
    if call is not None:
        return _body_time(call.module(), profile)
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return 0.0
    if node.target.overloadpacket.__name__ in VIEW_OPS or node.target is KEEP_ALIVE:
        return 0.0
    out = node.meta.get("val")
    moved = nbytes(out) + sum(nbytes(_val(a)) for a in node.all_input_nodes)
    flops = 0
    formula = flop_registry.get(node.target.overloadpacket)
    if formula is not None:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), _val)
        try:
            flops = concrete(formula(*args, out_val=out, **kwargs))
        except Exception:  # a formula that does not fit this overload: count bytes only
            flops = 0
    return flops / profile.flops_per_s + moved / profile.mem_bytes_per_s


def _body_time(body: fx.GraphModule, profile: HardwareProfile) -> float:
    """The compute time of a block's subgraph (`block_gathers.py`), once per subgraph and profile."""
    times = body.meta.setdefault("fsdp2.compute_time", {})
    if profile not in times:
        times[profile] = sum(compute_time(n, profile) for n in body.graph.nodes)
    return times[profile]


def node_time(node: fx.Node, profile: HardwareProfile) -> float:
    """Seconds `node` keeps its lane busy (the communication lane for collectives, else the compute lane)."""
    if collective_kind(node) is not None:
        return collective_time(node, profile)
    return compute_time(node, profile)


@dataclass(frozen=True)
class Event:
    name: str
    lane: str
    """"compute", "comm" or "wait" (compute blocked on communication)."""
    start_s: float
    duration_s: float


@dataclass
class Timeline:
    events: list[Event] = field(default_factory=list)
    total_s: float = 0.0
    exposed_comm_s: float = 0.0
    comm_s: float = 0.0
    compute_s: float = 0.0
    peak_bytes: int = 0
    """Peak bytes of tensors the graph allocates that are alive at once (its inputs not counted; its outputs, such
    as activations saved for backward, counted until the end)."""
    memory: list[tuple[float, int]] = field(default_factory=list)
    """(time, live intermediate bytes) after each node."""


def simulate(gm: fx.GraphModule, profile: HardwareProfile) -> Timeline:
    """Play `gm` in its current order and return the estimated timeline."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    last_use = {}
    for i, n in enumerate(nodes):
        for p in n.all_input_nodes:
            last_use[p] = i
    for p in gm.graph.output_node().all_input_nodes:  # graph outputs (incl. saved activations) outlive the graph
        last_use[p] = len(nodes)
    tl = Timeline()
    now = comm_free = 0.0
    done_at: dict[fx.Node, float] = {}
    live = 0
    owned: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        if collective_kind(n) is not None:
            start = max(now, comm_free)
            duration = collective_time(n, profile)
            comm_free = done_at[n] = start + duration
            tl.comm_s += duration
            tl.events.append(Event(n.name, "comm", start, duration))
        elif n.target is WAIT:
            ready = done_at.get(WaitArgs.of(n).tensor, now)
            if ready > now:
                tl.events.append(Event(n.name, "wait", now, ready - now))
                tl.exposed_comm_s += ready - now
                now = ready
        else:
            duration = compute_time(n, profile)
            if duration > 0:
                tl.events.append(Event(n.name, "compute", now, duration))
                tl.compute_s += duration
                now += duration
        is_view = (
            n.op == "call_function"
            and getattr(n.target, "overloadpacket", None) is not None
            and (n.target.overloadpacket.__name__ in VIEW_OPS or n.target is WAIT)
        )
        if n.op == "call_function" and not is_view:
            owned[n] = nbytes(n.meta.get("val"))
            live += owned[n]
        tl.peak_bytes = max(tl.peak_bytes, live)
        for p in n.all_input_nodes:
            if last_use.get(p) == i and p in owned:
                live -= owned.pop(p)
        tl.memory.append((now, live))
    tl.total_s = max(now, comm_free)
    return tl
