"""torchao's float8 training with FSDP2's float8 all-gather (`enable_fsdp_float8_all_gather=True`): the GPT's
Linear weights are cast to float8 before their all-gather and gathered as one byte per element, and training is
bitwise equal to `fully_shard` with the same torchao config (fp32 and bf16 parameters) on 2 ranks."""

from __future__ import annotations

import pytest
import torch
from float8_workers import float8_training
from harness import run_ranks

pytest.importorskip("torchao")


def test_float8_all_gather_trains_as_fully_shard():
    for rank, result in enumerate(run_ranks(float8_training, 2)):
        for bf16 in (False, True):
            ours, fsdp2 = result[("ours", bf16)], result[("fsdp2", bf16)]
            assert ours["losses"] == fsdp2["losses"], (rank, bf16)
            for name, value in ours["params"].items():
                assert torch.equal(value, fsdp2["params"][name]), (rank, bf16, name)
            # every Linear weight but the head's (left high-precision) is gathered as one byte per element, alone
            # or with others in its bucket, and nothing else is
            float8 = {n for n in ours["params"] if n.startswith("blocks.") and n.endswith("weight") and ".ln" not in n}
            gathered_as_bytes = set()
            for params, dtype, nbytes in ours["gathers"]:
                if dtype == torch.uint8:
                    assert set(params) <= float8, params
                    assert nbytes == sum(ours["params"][p].numel() for p in params), params
                    gathered_as_bytes.update(params)
                else:
                    assert not set(params) & float8, params
            assert gathered_as_bytes == float8


def test_a_torchao_outside_the_tested_versions_is_named_when_float8_is_sharded(fake_pg, monkeypatch):
    import importlib.metadata

    from torch import nn
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    import fsdp2_compile as fc
    from fsdp2_compile._torch_private import ALLOW_UNSUPPORTED_TORCH, SUPPORTED_TORCHAO_SPEC, UnsupportedTorchError
    from fsdp2_compile.runtime.float8 import _check_torchao

    installed = importlib.metadata.version

    def version(name: str) -> str:
        return "0.99.0" if name == "torchao" else installed(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    _check_torchao.cache_clear()  # checked once a process: here with the patched version
    monkeypatch.delenv(ALLOW_UNSUPPORTED_TORCH, raising=False)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    model = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=config)
    try:
        with pytest.raises(UnsupportedTorchError) as raised:
            fc.shard(model, check_same_init=False)
    finally:
        _check_torchao.cache_clear()  # the next check reads the installed version again
    assert "torchao 0.99.0 is not supported" in str(raised.value)
    assert f"torchao{SUPPORTED_TORCHAO_SPEC}" in str(raised.value)
