"""The process groups the library creates (docs/architecture.md lists them): on gloo, one one-thread twin per mesh
group that FSDP's collectives use, made once; none per `shard` call, compile, step or save after that (4 gloo
ranks); none at all on any other backend."""

from __future__ import annotations

import pytest
from group_count_workers import groups_created
from harness import run_ranks
from torch import nn

import fsdp2_compile as fc

TWINS = {"1d": [4], "hsdp": [2, 2], "fsdp_tp": [2]}
"""The mesh groups FSDP's collectives run on, by size: dp; HSDP's shard and replicate groups; FSDP + TP's dp."""


@pytest.mark.parametrize("layout", sorted(TWINS))
def test_groups_are_made_once_per_mesh_group_and_only_on_gloo(layout, tmp_path):
    for rank, created in enumerate(run_ranks(groups_created, 4, layout, str(tmp_path))):
        first_shard = sorted(size for phase, size in created if phase == "shard 0")
        assert first_shard == sorted(TWINS[layout]), (rank, created)
        assert [phase for phase, _ in created if phase != "shard 0"] == [], (rank, created)


def test_no_group_is_made_on_a_backend_other_than_gloo(fake_pg, monkeypatch):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: calls.append((a, k)))
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fc.shard(model[0])
    fc.shard_compile(model)
    assert calls == []
