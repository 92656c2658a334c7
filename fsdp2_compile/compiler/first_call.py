"""A compiled module's first call, on every rank, before anything is compiled: the ranks of its parameters'
process groups agree on how the call starts — whether each has `CompileConfig.compile_cache` (a rank that differs
is named at once on every rank) — through one store exchange costing each rank a constant number of operations
(`rank_agreement.agree_at_first_call`). Unless `CompileConfig.hardware` names a profile or `compile_cache` is on
(whose keys need the same figures in every launch), each of those groups has its link measured once
(`link_profile.measure_profile`, bounded in bytes), so the scheduler's figures are agreed before the first graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from fsdp2_compile._torch_private import own_parameters, resolve_group
from fsdp2_compile.config import CompileConfig
from fsdp2_compile.runtime.link_profile import measure_profile
from fsdp2_compile.runtime.param_state import ParamInfo
from fsdp2_compile.runtime.rank_agreement import agree_at_first_call

__all__ = ["start"]

Places = Sequence[tuple[nn.Module, str, ParamInfo]]


def start(places: Places, config: CompileConfig) -> None:
    """What every rank runs at a compiled module's first call."""
    groups = {name for _, _, info in places for name in (info.group_name, info.replicate_group_name) if name}
    agree_at_first_call(groups, {"compile_cache": str(config.compile_cache)})
    if config.hardware is None and not config.compile_cache:
        _measure_links(places)


def _measure_links(places: Places) -> None:
    """The link profile of each shard group of more than one rank, in the order the module holds them (the same on
    every rank), agreed over every dim of the meshes its parameters span (HSDP's replicas, tensor parallelism:
    ranks whose graphs share collectives), not over the rest of the device mesh (pipeline stages make their
    first calls at other times)."""
    groups: dict[str, tuple[int, str, dict[str, None]]] = {}
    for mod, name, info in places:
        mesh = getattr(own_parameters(mod)[name], "device_mesh", None)  # None: replaced since (the backend names it)
        if info.world_size > 1 and mesh is not None:
            _, _, spanned = groups.setdefault(info.group_name, (info.world_size, mesh.device_type, {}))
            if mesh.ndim > 1:
                spanned.update(dict.fromkeys(mesh.get_group(i).group_name for i in range(mesh.ndim)))
    for group_name, (world_size, device_type, spanned) in groups.items():
        if dist.get_backend(resolve_group(group_name)) != "fake":
            measure_profile(group_name, world_size, device_type, agree_over=list(spanned))
