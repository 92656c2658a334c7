"""Per-rank jobs for tests/test_process_groups.py: the process groups that sharding, compiling, training and
saving a checkpoint create, counted on the layouts large runs use."""

from __future__ import annotations

import torch.distributed as dist
from models import batch, local_slice, loss_fn, make_model, make_optimizer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp2_compile as fc
from fsdp2_compile.checkpoint import save_checkpoint

LAYOUTS = {"1d": ((4,), ("dp",)), "hsdp": ((2, 2), ("replicate", "shard")), "fsdp_tp": ((2, 2), ("dp", "tp"))}


def groups_created(rank: int, world_size: int, layout: str, checkpoint_dir: str) -> list[tuple[str, int]]:
    """(phase, group size) of each `new_group` call, for two models sharded, trained and saved one after the other
    on one mesh of `layout` (the second must reuse what the first created)."""
    shape, names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_mesh = mesh["dp"] if layout == "fsdp_tp" else mesh
    dp_rank, dp_size = (dp_mesh.get_local_rank(), 2) if layout == "fsdp_tp" else (rank, world_size)
    created: list[tuple[str, int]] = []
    phase = [""]
    new_group = dist.new_group

    def counting(*args, **kwargs):
        group = new_group(*args, **kwargs)
        created.append((phase[0], group.size()))
        return group

    dist.new_group = counting
    try:
        for index in range(2):
            phase[0] = f"shard {index}"
            model = make_model("gpt")
            if layout == "fsdp_tp":
                for block in model.blocks:
                    parallelize_module(block, mesh["tp"], {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
            for block in model.blocks:
                fc.shard(block, dp_mesh)
            fc.shard_compile(model, dp_mesh)
            phase[0] = f"train {index}"
            opt = make_optimizer(model)
            for step in range(2):
                x, y = (local_slice(t, dp_rank, dp_size) for t in batch("gpt", step))
                loss_fn("gpt", model(x), y).backward()
                opt.step()
                opt.zero_grad()
            phase[0] = f"save {index}"
            save_checkpoint(f"{checkpoint_dir}/{index}", model, opt)
    finally:
        dist.new_group = new_group
    return created
