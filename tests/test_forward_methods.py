"""`register_fsdp_forward_method`: a method other than `forward` runs with its module's parameters gathered and
its inputs cast, as FSDP2's function of the same name makes it; training through it is bitwise equal to
`fully_shard`'s (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from forward_method_workers import Features, forward_method
from harness import run_ranks

import fsdp2_compile as fc


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_registered_forward_method_trains_as_under_fully_shard(bf16):
    for rank, result in enumerate(run_ranks(forward_method, 2, bf16)):
        ours, fsdp2 = result["ours"], result["fsdp2"]
        assert ours["losses"] == fsdp2["losses"], (rank, ours["losses"], fsdp2["losses"])
        for name, value in fsdp2["params"].items():
            assert torch.equal(ours["params"][name], value), (rank, name)


def test_registering_a_missing_method_is_named(fake_pg):
    model = Features()
    fc.shard(model)
    with pytest.raises(ValueError, match="Features has no method 'generate'"):
        fc.register_fsdp_forward_method(model, "generate")


def test_a_module_that_is_not_sharded_is_left_as_it_is():
    model = Features()
    method = model.features
    fc.register_fsdp_forward_method(model, "features")
    assert model.features == method
