"""torch.distributed.checkpoint with sharded modules: saved at one world size, loaded at another (issue 6, part 1)."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks
from workers import checkpoint_load, checkpoint_save


@pytest.mark.parametrize("save_ranks,load_ranks", [(2, 4), (4, 2)])
def test_dcp_save_and_load_at_another_world_size(tmp_path, save_ranks, load_ranks):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(checkpoint_save, save_ranks, path)[0]
    loaded = run_ranks(checkpoint_load, load_ranks, path)[0]
    for part in ("params", "optim"):
        assert saved["saved"][part].keys() == loaded["loaded"][part].keys()
        for k, v in saved["saved"][part].items():
            assert torch.equal(v, loaded["loaded"][part][k]), f"{part} {k} differs after loading"  # bit-identical
    # the steps after loading match the steps the saving run took next (other world size: fp32 parity bound)
    torch.testing.assert_close(loaded["losses"], saved["losses"], rtol=1e-5, atol=0)
