"""The hardware profile measured on a real process group (`measure_profile`): what the ranks agree once per group,
at the first call of a module compiled with `CompileConfig.hardware=None`, so that every rank's compiler schedules
with the same figures.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from fsdp2_compile._torch_private import all_gather_single, resolve_group
from fsdp2_compile._torch_private import functional_collectives as _funcol
from fsdp2_compile.core.group_caches import dropped_with_groups
from fsdp2_compile.core.hardware import HardwareProfile

__all__ = ["measure_profile", "measured_profile"]

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
    must order them alike. Collective: every rank of those groups must call it (a compiled module's first call
    does, once per group, outside any compilation: `compiler/first_call.py`)."""
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
        return seconds(lambda: all_gather_single(out, inp, group=group))

    # Bounded whatever the group's size: 1 KiB gathered at most (one float per rank beyond 256 ranks), and
    # 4 MiB per rank or 64 MiB gathered, whichever is smaller
    small = max(1, 256 // world_size)
    large = max(small + 1, min(1 << 20, (16 << 20) // world_size))
    t_small, t_large = link(small), link(large)
    a = torch.full((384, 384), 0.5, device=device_type)  # no random draw: the user's generators stay as they are
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
        source=f"measured on the process group (all-gathers of {4 * small} and {4 * large} bytes per rank, 384^3 matmul, "
        "8 MiB copy; max over ranks)",
    )
    return _MEASURED[group_name]
