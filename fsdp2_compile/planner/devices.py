"""What the planner assumes of each device, beside the cost model's link figures (`hardware.PROFILES`): peak FLOP/s,
memory bandwidth, the fraction of each that an op class reaches, per-op launch time, whether communication runs
beside compute, and how an allocator's reserved memory relates to the live bytes. The figures and their sources are
in data/hardware_profiles.json; "calibrated" ones were fitted on one published run only (named), the others are
checked against, never fitted to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp2_compile.core.hardware import load_figures

__all__ = ["DEVICES", "DeviceFigures", "device_for"]


@dataclass(frozen=True)
class DeviceFigures:
    peak_flops: float
    """Dense FLOP/s of one rank in the compute dtype (the MFU denominator)."""
    mem_bytes_per_s: float
    """Memory bandwidth of one rank."""
    efficiency: dict[str, float]
    """Fraction of peak reached by op class: "matmul", "attention" (of peak_flops), "memory" (of bandwidth:
    elementwise ops) and optionally "optimizer" (of bandwidth: the AdamW step; "memory" where absent)."""
    launch_s: float
    """Fixed time per op (kernel launch / eager dispatch)."""
    comm_overlaps_compute: bool
    """Whether a collective in flight progresses while the rank computes."""
    allocator_factor: float
    """Reserved (what the device reports) / allocated (live tensors) at the peak."""
    runtime_bytes: int
    """Memory a process holds before any tensor (runtime, libraries, CUDA context)."""
    intra_node_bytes_per_s: float = 0.0
    """Bandwidth of the link between ranks of one node, bytes/s each rank sends (tensor parallelism's collectives
    run on it: TP inside a node, FSDP across)."""
    intra_node_alpha_s: float = 0.0
    """Fixed cost of one collective on the intra-node link."""
    reduce_scatter_factor: float = 1.0
    """A reduce-scatter's link time over a ring's (N-1)/N of its full buffer (a ring: 1; an all-reduce: 2)."""
    float8_flops: float = 0.0
    """Dense float8 FLOP/s of one rank (float8 training's Linear matmuls run at it x the matmul efficiency); 0: the
    device has no float8 matmul."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each figure comes from, by field name ("efficiency.matmul" for one op class)."""


def _devices() -> dict[str, DeviceFigures]:
    """data/hardware_profiles.json's `devices`; an entry with `like` starts from that entry's figures and sources."""
    entries = load_figures()["devices"]

    def resolved(name: str) -> dict:
        entry = dict(entries[name])
        base = resolved(entry.pop("like")) if "like" in entry else {}
        return {**base, **entry, "sources": {**base.get("sources", {}), **entry.get("sources", {})}}

    return {name: DeviceFigures(**resolved(name)) for name in entries}


DEVICES: dict[str, DeviceFigures] = _devices()
_DEFAULT = "cpu-gloo-loopback"


def device_for(profile_name: str) -> DeviceFigures:
    """The planner's figures for a cost-model profile (a measured profile: the CPU figures)."""
    return DEVICES.get(profile_name, DEVICES[_DEFAULT])
