"""What one rank can do, as the cost model reads it: an alpha-beta link and compute rates (`HardwareProfile`), and
the named profiles the scheduler, the CLI and the planner choose from (`PROFILES`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PROFILES", "HardwareProfile"]


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
            "cpu-gloo-loopback",
            500e-6,
            1 / 0.38e9,
            97e9,
            19e9,
            "measured on the 2-core CI machine, 2 ranks on gloo over loopback: alpha and link by measure_profile "
            "(2026-11-29: alpha 0.46-0.58 ms, 0.36-0.40 GB/s), rounded; compute on one thread as each rank has by "
            "benchmarks/cpu_figures.py (2026-11-30, best of 40 runs: fp32 matmul 97 GFLOP/s at a GPT Linear's "
            "shapes, 19 GB/s read + written by a transformer's elementwise ops)",
        ),
        HardwareProfile(
            "cpu-gloo-1gbit",
            400e-6,
            1 / 58e6,
            97e9,
            19e9,
            "the benchmark's 1 Gbit/s link (benchmarks/run.py: tc tbf rate 1gbit on the loopback of a network "
            "namespace, which both ranks' traffic crosses, so each rank gets half while both send), measured by "
            "benchmarks/link_figures.py (2026-11-30, 2 ranks: all-gathers of 1 KiB 0.41 ms, of 16 MiB per rank "
            "0.288 s = 58 MB/s sent per rank); compute as cpu-gloo-loopback",
        ),
        HardwareProfile(
            "h100-nvlink",
            15e-6,
            1 / 360e9,
            700e12,
            2.8e12,
            "8x H100 SXM in one node, from NVIDIA's specs with assumed efficiencies (not measured here): NVLink 4 "
            "450 GB/s per direction x 0.8; 989 TFLOP/s dense bf16 x 0.7; HBM3 3.35 TB/s x 0.85",
        ),
        HardwareProfile(
            "h100-infiniband",
            30e-6,
            1 / 40e9,
            700e12,
            2.8e12,
            "H100 nodes over 400 Gb/s NDR InfiniBand per GPU: 50 GB/s spec x 0.8 assumed (not measured here); "
            "compute as h100-nvlink",
        ),
    )
}
