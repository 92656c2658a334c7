"""Per-rank jobs for tests/test_groups_of_one.py: the GPT trained by `fully_shard`, by `fc.shard` alone (eager)
and by `shard_compile` where a process group has one rank (a world of one; HSDP with one replica or a shard group
of one); each job returns every system's losses and parameters, and what our graphs and eager ops communicated."""

from __future__ import annotations

from unittest import mock

import torch
from models import make_model, make_optimizer
from workers import _gpt_steps

import fsdp2_compile as fc
from fsdp2_compile._torch_private import functional_collectives
from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, compiled_graphs
from fsdp2_compile.core.ir import PARAMS, CollectiveArgs, collective_kind

STEPS = 4
_FUNCOL = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def _build(system: str, mesh, param_dtype, divide_factor: float | None):
    """The GPT sharded per block, then the root, on `mesh` (None: the default 1-D one) by `system`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model("gpt")
    reduce_dtype = torch.float32 if param_dtype is not None else None
    if system == "fsdp2":
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        shard, root = fully_shard, fully_shard
    else:
        mp = fc.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        shard, root = fc.shard, (fc.shard_compile if system == "ours" else fc.shard)
    for block in model.blocks:
        shard(block, mesh=mesh, mp_policy=mp)
    root(model, mesh=mesh, mp_policy=mp)
    if divide_factor is not None:
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(divide_factor)
    return model


def _graph_ops(gm: torch.fx.GraphModule) -> list[tuple[str, int, bool]]:
    """(op, group size, serves parameters) of every `_c10d_functional` node of `gm` and of its subgraphs
    (group size -1 for a wait)."""
    found = []
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if getattr(node.target, "namespace", None) != "_c10d_functional":
                continue
            size = CollectiveArgs.of(node).ranks() if collective_kind(node) is not None else -1
            found.append((node.target.__name__, size, bool(node.meta.get(PARAMS))))
    return found


def train_systems(
    rank: int,
    world_size: int,
    mesh_shape=None,
    param_dtype=None,
    divide_factor=None,
    systems=("fsdp2", "eager", "ours"),
) -> dict:
    """`STEPS` AdamW steps of the GPT under each of `systems` on a mesh of `mesh_shape` ((replicate, shard); None:
    1-D over the world), with bf16 parameters and fp32 reduction when `param_dtype` is bf16 and
    `set_gradient_divide_factor(divide_factor)` on every group when given. Per system its losses and parameters;
    for "eager" the functional collectives it issued (by op), for "ours" each compiled graph's collective ops."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = None
    if mesh_shape is not None:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    out = {}
    for system in systems:
        clear_compiled_graphs()
        model = _build(system, mesh, param_dtype, divide_factor)
        opt = make_optimizer(model)
        counted = {name: mock.Mock(wraps=getattr(functional_collectives, name)) for name in _FUNCOL}
        with mock.patch.multiple(functional_collectives, **counted):
            out[system] = _gpt_steps(model, opt, rank, world_size, range(STEPS))
        out[f"{system}_params"] = {k: p.full_tensor() for k, p in model.named_parameters()}
        if system == "eager":
            out["eager_collectives"] = {name: m.call_count for name, m in counted.items()}
        if system == "ours":
            out["graphs"] = [(r.kind, _graph_ops(r.gm)) for r in compiled_graphs()]
    return out


def world_of_one_variants(rank: int, world_size: int) -> dict:
    """`train_systems` in one process of a world of one: fp32, bf16 parameters with fp32 reduction, and fp32 with
    a gradient divide factor of 3 (FSDP2 divides the copied gradient by it)."""
    return {
        "fp32": train_systems(rank, world_size),
        "bf16": train_systems(rank, world_size, param_dtype=torch.bfloat16),
        "divide": train_systems(rank, world_size, divide_factor=3.0),
    }


def hsdp_meshes(rank: int, world_size: int) -> dict:
    """`train_systems` on two ranks as (replicate 2, shard 1) and as (replicate 1, shard 2)."""
    return {shape: train_systems(rank, world_size, mesh_shape=shape) for shape in ((2, 1), (1, 2))}


def float8_world_of_one(rank: int, world_size: int) -> dict:
    """torchao float8 training (tests/float8_workers.py, fp32) under fully_shard and ours; our graphs' collective
    ops (the amax all-reduce included)."""
    import warnings

    from float8_workers import _train

    warnings.filterwarnings("ignore", module="torchao")
    out = {system: _train(system, False, system == "fsdp2", rank, world_size) for system in ("fsdp2", "ours")}
    out["graphs"] = [(r.kind, _graph_ops(r.gm)) for r in compiled_graphs()]
    return out
