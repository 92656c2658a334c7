"""Pipeline parallelism: stages sharded with fsdp2_compile over the dp slice of a (pp=2, dp=2) mesh, driven by torch's
own schedules (`torch.distributed.pipelining`) exactly as `fully_shard` stages are. Losses and parameters are
bitwise equal to `fully_shard`'s with the same layout and schedule, and each rank reduces its gradients once per
group and step (the schedules keep them unsharded over the micro-batches and reduce them after the last backward),
as many reductions as `fully_shard` issues."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks
from pipeline_workers import pipelined_training


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_pipeline_schedules_drive_sharded_stages_as_fully_shard_ones(schedule):
    for rank, result in enumerate(run_ranks(pipelined_training, 4, schedule)):
        ours, fsdp2 = result["ours"], result["fsdp2"]
        assert ours["losses"] == fsdp2["losses"], rank
        if rank >= 2:  # the last stage's ranks have the losses
            assert all(len(step) == 4 for step in ours["losses"])
        assert ours["params"].keys() == fsdp2["params"].keys()
        for name, value in ours["params"].items():
            assert torch.equal(value, fsdp2["params"][name]), (rank, name)
        # the gloo collectives that reduce (fully_shard's reduce-scatter is an all-reduce on gloo)
        assert ours["reductions"] == fsdp2["reductions"], rank
        # a group per stage module with parameters of its own and per layer: 2 stages of one layer a rank (3 groups)
        # interleaved, else one stage of one layer (2)
        assert sum(ours["reductions"].values()) == (3 if schedule == "interleaved" else 2)


def test_pipeline_stages_with_tensor_parallel_layers_as_fully_shard_ones():
    """8 ranks, pp 2 x dp 2 x tp 2: the layers' MLPs tensor-parallel on mesh["tp"], then sharded over mesh["dp"],
    under Schedule1F1B: bitwise equal to fully_shard with the same layout, the same reducing collectives."""
    for rank, result in enumerate(run_ranks(pipelined_training, 8, "1f1b", 2)):
        ours, fsdp2 = result["ours"], result["fsdp2"]
        assert ours["losses"] == fsdp2["losses"], rank
        for name, value in ours["params"].items():
            assert torch.equal(value, fsdp2["params"][name]), (rank, name)
        assert ours["reductions"] == fsdp2["reductions"], rank
