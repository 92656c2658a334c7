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
