"""FSDP + TP bad input: `shard` refuses tensor-parallel parameters it cannot shard over its mesh
with a ValueError naming the parameter and both meshes, raised from the meshes' layouts alone (every rank holds them
whole, so every rank raises the same) before `shard` creates a group or measures the link, and leaves the module
untouched. In-process, on the fake process group (any world size)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_user_errors import raises
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp2_compile as fc

shard_module = __import__("importlib").import_module("fsdp2_compile.runtime.sharding")

MESH_GROUPS = shard_module._mesh_groups
RECIPE = "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))"


@pytest.fixture(params=[0, 5])
def fake8(request, monkeypatch):
    """A fake default process group of 8 ranks (as rank 0 and as rank 5); reaching `_mesh_groups` (the first step
    of `shard` that creates groups or communicates) fails the test."""
    from fsdp2_compile._torch_private import fake_process_group

    fake_process_group(rank=request.param, world_size=8)

    def no_collective(*args):
        raise AssertionError("shard reached its groups / collectives before refusing the input")

    monkeypatch.setattr(shard_module, "_mesh_groups", no_collective)
    yield request.param
    dist.destroy_process_group()


def tp_net(tp_mesh) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    return parallelize_module(net, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def refused(net: nn.Module, mesh, *patterns: str) -> None:
    before = {k: (type(p), p.device_mesh, p.placements) for k, p in net.named_parameters()}
    with raises(ValueError, "parameter '0.weight'", *patterns):
        fc.shard(net, mesh)
    assert not fc.is_sharded(net)
    assert {k: (type(p), p.device_mesh, p.placements) for k, p in net.named_parameters()} == before  # untouched


def test_the_tp_mesh_passed_instead_of_the_dp_mesh(fake8):
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    refused(
        tp_net(mesh["tp"]),
        mesh["tp"],
        "tensor-parallel mesh (tp=2)",
        "shard's mesh (tp=2) has the same dim ['tp']",
        "shard(module, mesh['dp'])",
    )
    # the whole 2-D mesh: it contains the TP dim too
    refused(tp_net(mesh["tp"]), mesh, "shard's mesh (dp=4, tp=2) has the same dim ['tp']")


def test_a_dp_mesh_that_overlaps_the_tp_mesh(fake8):
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    # another init_device_mesh over the same ranks, laid out the other way: its "dp" groups are mesh's tp pairs
    other = init_device_mesh("cpu", (2, 4), mesh_dim_names=("x", "dp"))
    refused(
        tp_net(mesh["tp"]),
        other["dp"],
        "tensor-parallel mesh (tp=2)",
        "shard's mesh (dp=4) does not extend",
        "they overlap",
        RECIPE,
    )
    # the TP mesh under another name
    same_ranks = init_device_mesh("cpu", (4, 2), mesh_dim_names=("a", "dp"))
    refused(tp_net(mesh["tp"]), same_ranks["dp"], "does not extend", "they overlap")


def test_a_dp_mesh_over_other_ranks_than_the_tp_mesh(fake8):
    if fake8 >= 4:
        pytest.skip("a rank outside the 4-rank TP mesh holds no TP model")
    small = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # ranks 0-3 only
    whole = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    refused(
        tp_net(small["tp"]),
        whole,
        "tensor-parallel mesh (tp=2)",
        "shard's mesh (dp=8) does not extend",
        "meshes over different ranks",
        RECIPE,
    )


def test_the_default_mesh_with_tp_parameters(fake8):
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    refused(tp_net(mesh["tp"]), None, "(the default 1-D mesh over every rank) has no dim names", RECIPE)


def test_a_sibling_dp_mesh_from_another_init_device_mesh_is_accepted(fake8, monkeypatch):
    # the same ranks and an orthogonal layout: what mesh["dp"] of the TP mesh's own root would be, so it extends it
    monkeypatch.setattr(shard_module, "_mesh_groups", MESH_GROUPS)
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    net = fc.shard(tp_net(mesh["tp"]), other["dp"])
    w = net[0]._parameters["weight"]
    assert isinstance(w, DTensor) and w.device_mesh.mesh_dim_names == ("dp", "tp")
    assert tuple(map(str, w.placements)) == ("_S(0, 2)", "S(0)")


def test_partial_placements(fake8):
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    net = tp_net(mesh["tp"])
    net[0].weight = nn.Parameter(distribute_tensor(torch.ones(8, 8), mesh["tp"], [Partial()]))
    refused(
        net,
        mesh["dp"],
        "placements (Partial(sum),)",
        "cannot be sharded over shard's mesh (dp=4)",
        "Shard or Replicate",
    )


def test_a_2d_tp_mesh(fake8):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "tp", "cp"))
    net = tp_net(mesh["tp"])
    net[0].weight = nn.Parameter(distribute_tensor(torch.ones(8, 8), mesh["tp", "cp"], [Shard(0), Shard(1)]))
    refused(
        net, mesh["dp"], "tensor-parallel mesh (tp=2, cp=2)", "a 2-D mesh", "1-D tensor parallelism only", "mesh['tp']"
    )
