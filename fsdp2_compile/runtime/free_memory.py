"""`CompileConfig.memory_budget_fraction`: the memory budget as a fraction of the free memory of the mesh's
device, measured once when `shard_compile` is called and agreed over the mesh's ranks (the smallest figure), so
that every rank keeps the same buckets gathered and issues the same collectives."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp2_compile._torch_private import resolve_group, root_mesh_groups
from fsdp2_compile.config import CompileConfig

__all__ = ["free_bytes", "resolve_memory_budget"]

log = logging.getLogger("fsdp2_compile")


def free_bytes(device_type: str) -> int:
    """Free memory for one rank on a device of `device_type`: CUDA's free device memory; on the CPU, the host's
    available memory (`MemAvailable`) divided among the ranks on the host (`LOCAL_WORLD_SIZE`, else every rank)."""
    if device_type == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    if device_type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError) as e:
            raise RuntimeError(
                "CompileConfig.memory_budget_fraction: cannot read this host's available memory (/proc/meminfo "
                f"MemAvailable: {e!r}); use CompileConfig.memory_budget_bytes"
            ) from None
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
        return kib * 1024 // max(1, ranks_here)
    raise ValueError(
        f"CompileConfig.memory_budget_fraction: free memory on {device_type!r} devices is not known here; use "
        "CompileConfig.memory_budget_bytes"
    )


def resolve_memory_budget(config: CompileConfig, mesh: DeviceMesh) -> CompileConfig:
    """`config` with `memory_budget_bytes` = `memory_budget_fraction` x the smallest free memory of the mesh's
    ranks (an all-reduce over every dim of the mesh and of the mesh it was sliced from); `config` itself without
    a fraction. Collective: every rank of the mesh calls it (`shard_compile` does)."""
    if config.memory_budget_fraction is None:
        return config
    mine = int(config.memory_budget_fraction * free_bytes(mesh.device_type))
    agreed = torch.tensor([mine], dtype=torch.int64, device=mesh.device_type)
    groups = dict.fromkeys(mesh.get_group(d) for d in range(mesh.ndim))
    for name in root_mesh_groups(mesh):
        groups.setdefault(resolve_group(name))
    for group in groups:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    budget = max(1, int(agreed.item()))
    log.info(
        "memory_budget_fraction %g: memory_budget_bytes %d (this rank's share of free memory: %d bytes, the "
        "smallest over the mesh's ranks taken)",
        config.memory_budget_fraction,
        budget,
        mine,
    )
    return dataclasses.replace(config, memory_budget_bytes=budget, memory_budget_fraction=None)
