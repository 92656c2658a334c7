"""`shard` in one process (fake process group, rank 3 of 4): layout, names, and the errors a user can cause."""

from __future__ import annotations

import pytest
import torch
from models import MLP
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp2_compile as fc
from fsdp2_compile.runtime.read_only_param import GatheredCopy


def test_parameters_become_dim0_sharded_dtensors_with_original_names(fake_pg):
    model = MLP()
    names = [n for n, _ in model.named_parameters()]
    shapes = {n: p.shape for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    fc.shard(model, ignored_params=[model.scale])

    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
    for name, p in model.named_parameters():
        assert p.shape == shapes[name], name  # logical (unpadded) shape
        if name == "scale":
            assert type(p) is nn.Parameter  # ignored: left as it is
            continue
        assert isinstance(p, DTensor) and isinstance(p, nn.Parameter) and p.placements == (Shard(0),), name
    # rank 3 of 4 holds torch.chunk's last piece: 33 rows -> 9, 9, 9, 6; 3 rows -> 1, 1, 1, (none); 1 row -> none
    params = dict(model.named_parameters())
    assert params["fc1.weight"].to_local().shape == (6, 16)
    assert params["fc2.weight"].to_local().shape == (0, 33)
    assert params["head.bias"].to_local().shape == (0,)
    assert not params["frozen.weight"].requires_grad and params["fc1.weight"].requires_grad
    assert type(model.shift) is torch.Tensor  # buffers are not sharded


def test_reading_a_parameter_attribute_gathers_it(fake_pg):
    model = nn.Linear(5, 7)
    fc.shard(model)
    w = model.weight
    assert isinstance(w, GatheredCopy) and w.shape == (7, 5)  # the gathered parameter (fake group: data undefined)
    assert type(w * 2) is torch.Tensor  # computes as a plain tensor


def test_blocks_then_root_and_tied_parameters(fake_pg):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.block = nn.Linear(4, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    fc.shard(model.block)
    fc.shard(model)
    assert model.head.weight.shape == (10, 4)
    assert model.emb._parameters["weight"] is model.head._parameters["weight"]
    assert len(list(model.parameters())) == 3
    assert fc.is_sharded(model) and fc.is_sharded(model.block) and not fc.is_sharded(model.emb)


def test_parameters_tied_across_two_shard_calls_stay_one_parameter(fake_pg):
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    root = nn.ModuleDict(dict(emb=emb, head=head))
    fc.shard(emb)
    fc.shard(root)
    assert head._parameters["weight"] is emb._parameters["weight"]
    assert isinstance(head._parameters["weight"], DTensor)


def test_zero_dim_parameter_is_refused_with_its_name(fake_pg):
    model = nn.Module()
    model.temperature = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"'temperature' is 0-dimensional.*ignored_params"):
        fc.shard(model)


def test_zero_dim_parameter_can_be_ignored(fake_pg):
    model = nn.Linear(3, 3)
    model.temperature = nn.Parameter(torch.tensor(1.0))
    fc.shard(model, ignored_params=[model.temperature])
    assert type(model.temperature) is nn.Parameter and isinstance(model.weight, torch.Tensor)


def test_mesh_with_three_dims_is_refused(fake_pg):
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c"))
    with pytest.raises(ValueError, match=r"3-D mesh .*1-D mesh"):
        fc.shard(nn.Linear(2, 2), mesh)


def test_sharding_twice_is_refused(fake_pg):
    model = nn.Linear(2, 2)
    fc.shard(model)
    with pytest.raises(ValueError, match="Linear is already sharded"):
        fc.shard(model)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, "bf16"])
def test_non_floating_param_dtype_is_refused(dtype):
    with pytest.raises(ValueError, match="param_dtype=.* is not a floating-point dtype"):
        fc.MixedPrecisionPolicy(param_dtype=dtype)


def test_parameter_on_another_device_than_the_mesh_is_refused(fake_pg):
    mesh = init_device_mesh("meta", (4,))
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"parameter '0.weight' is on device 'cpu' but the mesh is on 'meta'"):
        fc.shard(model, mesh)


def test_shard_without_process_group_says_what_to_do():
    with pytest.raises(RuntimeError, match="init_process_group"):
        fc.shard(nn.Linear(2, 2))


def test_replacing_a_parameter_after_sharding_is_named(fake_pg):
    model = nn.Linear(2, 2)
    fc.shard(model)
    model.weight = nn.Parameter(torch.ones(2, 2))
    with pytest.raises(TypeError, match="parameter 'weight' was replaced"):
        model(torch.ones(1, 2))


def test_mixed_precision_casts_inputs_and_outputs(fake_pg):
    bf16 = torch.bfloat16
    x = torch.randn(2, 4)
    model = fc.shard(nn.Linear(4, 4), mp_policy=fc.MixedPrecisionPolicy(param_dtype=bf16))
    assert model(x).dtype == bf16  # fp32 input cast to bf16, computed with bf16 weights
    model = fc.shard(nn.Linear(4, 4), mp_policy=fc.MixedPrecisionPolicy(param_dtype=bf16, output_dtype=torch.float32))
    assert model(x).dtype == torch.float32
    model = fc.shard(nn.Linear(4, 4), mp_policy=fc.MixedPrecisionPolicy(param_dtype=bf16, cast_forward_inputs=False))
    with pytest.raises(RuntimeError, match="dtype"):
        model(x)  # an fp32 input meets bf16 weights: the user asked not to cast


def test_hsdp_mesh_replicates_over_dim_0_and_shards_over_dim_1(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # rank 3: replica 1, shard 1
    model = fc.shard(nn.Linear(4, 5), mesh)
    assert model.weight.shape == (5, 4)  # gathered from the shard group
    weight = dict(model.named_parameters())["weight"]
    assert weight.placements == (Replicate(), Shard(0)) and weight.shape == (5, 4)
    assert weight.to_local().shape == (2, 4)  # torch.chunk over the 2 shard ranks: 3, 2 rows


def test_two_dim_mesh_without_dim_names_is_refused(fake_pg):
    with pytest.raises(
        ValueError, match=r"2-D mesh \(2, 2\) without dim names.*mesh_dim_names=\(\"replicate\", \"shard\"\)"
    ):
        fc.shard(nn.Linear(4, 4), init_device_mesh("cpu", (2, 2)))


def test_set_requires_gradient_sync_recurses_like_fsdp2(fake_pg):
    from fsdp2_compile.runtime.sharding import managed_params

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fc.shard(model[0])
    fc.shard(model)
    sync = lambda: {name: info.requires_gradient_sync for name, _, info in managed_params(model)}  # noqa: E731
    model.set_requires_gradient_sync(False, recurse=False)  # only the root's own group
    assert sync() == {"0.weight": True, "0.bias": True, "1.weight": False, "1.bias": False}
    model.set_requires_gradient_sync(False)
    assert not any(sync().values())
    model[0].set_requires_gradient_sync(True)
    assert sync() == {"0.weight": True, "0.bias": True, "1.weight": False, "1.bias": False}


def _group_reshards(module: nn.Module) -> dict[str, bool]:
    """Ours: each group (bucket) -> whether its parameters reshard after forward."""
    from fsdp2_compile.runtime.sharding import managed_params

    return {info.bucket: info.reshard_after_forward for _, _, info in managed_params(module)}


def test_default_reshard_after_forward_keeps_the_root_as_fully_shard_does(fake_pg):
    """`reshard_after_forward=None` (both defaults): every group reshards after forward but the root's, which
    fully_shard (torch 2.13) leaves gathered because backward needs it first (its post-forward mesh is None); an
    explicit True reshards the root too, on both; `set_reshard_after_forward` sticks through later `shard` calls."""
    from torch.distributed.fsdp import fully_shard

    def built(shard, **root_kwargs):
        model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 2))
        shard(model[1][0])
        shard(model[1])
        shard(model, **root_kwargs)
        return model

    for root_kwargs in ({}, {"reshard_after_forward": True}):
        reference = built(fully_shard, **root_kwargs)
        reference(torch.zeros(2, 4))  # fully_shard decides the root at its first forward
        groups = {
            name: m._get_fsdp_state()._fsdp_param_group
            for name, m in reference.named_modules()
            if hasattr(m, "_get_fsdp_state")
        }
        expected = {name: g.post_forward_mesh_info is not None for name, g in groups.items()}
        assert expected == {"": bool(root_kwargs), "1": True, "1.0": True}
        assert _group_reshards(built(fc.shard, **root_kwargs)) == expected
    model = built(fc.shard)
    model.set_reshard_after_forward(True, recurse=False)
    outer = nn.ModuleList([model])
    fc.shard(outer)  # a later root over it: the choice stays, and the new root keeps its own (none here)
    assert _group_reshards(outer) == {"0": True, "0.1": True, "0.1.0": True}
