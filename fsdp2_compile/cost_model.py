"""The cost model every scheduling decision and every estimate uses (one model for the scheduler, the CLI and the
planner): collectives by an alpha-beta model, compute from FLOPs and bytes of each node's shapes.

`simulate(gm, profile)` plays a graph in its order on one compute lane and one communication lane (collectives run
in issue order, a wait blocks compute until its collective ends) and returns the timeline, the exposed
communication and the live bytes over the step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx
from torch.utils.flop_counter import flop_registry

from ._torch_private import resolve_group
from .comm_groups import dropped_with_groups
from .ir import KEEP_ALIVE, WAIT, CollectiveArgs, Role, SubgraphCall, WaitArgs, collective_kind, concrete, nbytes

__all__ = [
    "PROFILES",
    "Event",
    "HardwareProfile",
    "Timeline",
    "concrete",
    "measure_profile",
    "measured_profile",
    "node_time",
    "simulate",
]

_funcol = torch.ops._c10d_functional
_VIEWS = {"view", "_unsafe_view", "slice", "t", "transpose", "permute", "expand", "alias", "select", "split",
          "split_with_sizes", "unsqueeze", "squeeze", "as_strided", "detach", "unbind", "reshape"}


@dataclass(frozen=True)
class HardwareProfile:
    """What one rank can do. A collective over N ranks moving a B-byte full buffer takes
    alpha_s + (N-1)/N * B * beta_s_per_byte; a compute node takes flops / flops_per_s + bytes / mem_bytes_per_s."""

    name: str
    alpha_s: float
    """Fixed cost of one collective (launch + latency), seconds."""
    beta_s_per_byte: float
    """Seconds per byte each rank sends (1 / link bandwidth)."""
    flops_per_s: float
    """Sustained matmul FLOP/s of one rank in the compute dtype."""
    mem_bytes_per_s: float
    """Sustained memory bandwidth of one rank, bytes/s (elementwise and copy nodes)."""
    source: str
    """Where the figures come from."""


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile(
            "cpu-gloo-loopback", 500e-6, 1 / 0.38e9, 97e9, 19e9,
            "measured on the 2-core CI machine, 2 ranks on gloo over loopback: alpha and link by measure_profile "
            "(2026-11-29: alpha 0.46-0.58 ms, 0.36-0.40 GB/s), rounded; compute on one thread as each rank has by "
            "benchmarks/cpu_figures.py (2026-11-30, best of 40 runs: fp32 matmul 97 GFLOP/s at a GPT Linear's "
            "shapes, 19 GB/s read + written by a transformer's elementwise ops)",
        ),
        HardwareProfile(
            "cpu-gloo-1gbit", 400e-6, 1 / 58e6, 97e9, 19e9,
            "the benchmark's 1 Gbit/s link (benchmarks/run.py: tc tbf rate 1gbit on the loopback of a network "
            "namespace, which both ranks' traffic crosses, so each rank gets half while both send), measured by "
            "benchmarks/link_figures.py (2026-11-30, 2 ranks: all-gathers of 1 KiB 0.41 ms, of 16 MiB per rank "
            "0.288 s = 58 MB/s sent per rank); compute as cpu-gloo-loopback",
        ),
        HardwareProfile(
            "h100-nvlink", 15e-6, 1 / 360e9, 700e12, 2.8e12,
            "8x H100 SXM in one node, from NVIDIA's specs with assumed efficiencies (not measured here): NVLink 4 "
            "450 GB/s per direction x 0.8; 989 TFLOP/s dense bf16 x 0.7; HBM3 3.35 TB/s x 0.85",
        ),
        HardwareProfile(
            "h100-infiniband", 30e-6, 1 / 40e9, 700e12, 2.8e12,
            "H100 nodes over 400 Gb/s NDR InfiniBand per GPU: 50 GB/s spec x 0.8 assumed (not measured here); "
            "compute as h100-nvlink",
        ),
    )
}


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
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    if node.target.overloadpacket.__name__ in _VIEWS or node.target is KEEP_ALIVE:
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
    """The compute time of a block's subgraph (`compiled_once.py`), once per subgraph and profile."""
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
        is_view = n.op == "call_function" and getattr(n.target, "overloadpacket", None) is not None and (
            n.target.overloadpacket.__name__ in _VIEWS or n.target is WAIT
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


_MEASURED: dict[str, HardwareProfile] = dropped_with_groups({})


def measured_profile(group_name: str) -> HardwareProfile | None:
    """The profile `measure_profile` agreed for this process group, if it ran."""
    return _MEASURED.get(group_name)


def measure_profile(
    group_name: str, world_size: int, device_type: str = "cpu", agree_over: Sequence[str] = ()
) -> HardwareProfile:
    """Alpha/beta measured with all-gathers on the real process group, FLOP/s and memory bandwidth measured
    locally; the slowest rank's figures are agreed by an all-reduce (MAX of times) over the group and then over
    each group of `agree_over` (the other dims of the mesh: HSDP's replicas, tensor parallelism), so every rank of
    the whole mesh gets the same profile and makes the same decisions — ranks whose graphs share any collective
    must order them alike. Collective: every rank of those groups must call it (`shard` does, once per group,
    outside any compilation)."""
    if group_name in _MEASURED:
        return _MEASURED[group_name]

    def seconds(fn, repeat: int = 3) -> float:
        """Median wall time of `fn` after one warm-up, device work included."""
        samples = []
        for _ in range(repeat + 1):
            start = time.perf_counter()
            fn()
            if device_type != "cpu":
                torch.accelerator.synchronize()
            samples.append(time.perf_counter() - start)
        return sorted(samples[1:])[repeat // 2]

    group = resolve_group(group_name)

    def link(per_rank: int) -> float:
        """Seconds for an all-gather of `per_rank` floats from each rank, into one output allocated once."""
        inp = torch.zeros(per_rank, device=device_type)
        out = torch.empty(per_rank * world_size, device=device_type)
        return seconds(lambda: dist.all_gather_single(out, inp, group=group))

    small, large = 256, min(1 << 20, (16 << 20) // world_size)  # 1 KiB; 4 MiB per rank, 64 MiB gathered at most
    t_small, t_large = link(small), link(large)
    a = torch.randn(384, 384, device=device_type)
    mm_s = seconds(lambda: a @ a)
    buf = torch.empty(1 << 21, device=device_type)  # 8 MiB: beyond a core's L2 cache, as a graph's tensors are
    copy_s = seconds(buf.clone)
    agreed = torch.tensor([t_small, t_large, mm_s, copy_s], dtype=torch.float64, device=device_type)
    for group_to_agree in (group_name, *agree_over):
        agreed = _funcol.wait_tensor(_funcol.all_reduce(agreed, "max", group_to_agree))
    t_small, t_large, mm_s, copy_s = agreed.tolist()
    wire = (world_size - 1) / world_size * (large - small) * 4 * world_size
    _MEASURED[group_name] = HardwareProfile(
        name=f"measured:{group_name}",
        alpha_s=t_small,
        beta_s_per_byte=max(t_large - t_small, 1e-9) / wire,
        flops_per_s=2 * 384**3 / mm_s,
        mem_bytes_per_s=2 * buf.nbytes / copy_s,
        source=f"measured on the process group (all-gather 1 KiB and {large >> 8} KiB per rank, 384^3 matmul, "
        "8 MiB copy; max over ranks)",
    )
    return _MEASURED[group_name]
