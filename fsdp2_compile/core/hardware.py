"""What one rank can do, as the cost model reads it: an alpha-beta link and compute rates (`HardwareProfile`), and
the named profiles the scheduler, the CLI and the planner choose from (`PROFILES`, read from
data/hardware_profiles.json with their sources).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources

__all__ = ["PROFILES", "HardwareProfile", "load_figures"]


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


@functools.cache
def load_figures() -> dict:
    """data/hardware_profiles.json: the profiles' figures and the planner's device figures, each with its source
    (read once; callers copy what they change)."""
    return json.loads(resources.files("fsdp2_compile").joinpath("data/hardware_profiles.json").read_text())


PROFILES: dict[str, HardwareProfile] = {
    name: HardwareProfile(
        name,
        alpha_s=p["alpha_s"],
        beta_s_per_byte=1 / p["link_bytes_per_s"],
        flops_per_s=p["flops_per_s"],
        mem_bytes_per_s=p["mem_bytes_per_s"],
        source=p["source"],
    )
    for name, p in load_figures()["profiles"].items()
}
