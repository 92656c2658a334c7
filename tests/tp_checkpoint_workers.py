"""Per-rank jobs for tests/test_tp_checkpoint.py: DCP checkpoints of FSDP + TP models (HF Llama, the plan of
tests/tp_workers.py on a 2 dp x 2 tp mesh) loaded into FSDP-only models on 2 ranks and back, and moved between
`fully_shard` + TP and `shard_compile` + TP both ways. Every job saves after steps 0-1 or loads and then takes
steps 2-3; the test compares those losses and the loaded state with the run that was not interrupted."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from real_model_workers import hf_model
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from tp_workers import build, step_loss
from workers import _full_state

import fsdp2_compile as fc
from fsdp2_compile.checkpoint import load_checkpoint, save_checkpoint


def _tp_mesh(world_size: int):
    return init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))


def _dp_only(world_size: int):
    """FSDP only: HF Llama sharded per layer, then the root, over all ranks."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model, layers = hf_model("llama")
    for layer in layers:
        fc.shard(layer, mesh)
    fc.shard_compile(model, mesh)
    return model, mesh


class Run:
    """A model, its AdamW and its dp coordinates; `steps(range)` trains and returns the losses (averaged over ranks:
    TP ranks hold the same loss)."""

    def __init__(self, system: str, world_size: int):
        if system == "dp-only":
            self.model, mesh = _dp_only(world_size)
            self.dp_rank, self.dp_size = mesh.get_local_rank(), mesh.size()
        else:  # "ours" / "fsdp2", + TP
            mesh = _tp_mesh(world_size)
            self.model = build("llama", system, mesh)
            self.dp_rank, self.dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def steps(self, steps) -> list[float]:
        losses = []
        for step in steps:
            loss = step_loss("llama", self.model, step, self.dp_rank, self.dp_size)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            losses.append(total.item() / dist.get_world_size())
        return losses

    def state(self) -> dict:
        return {part: {k: v.clone() for k, v in d.items()} for part, d in _full_state(self.model, self.opt).items()}

    def dcp_save(self, path: str) -> None:
        msd, osd = get_state_dict(self.model, self.opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    def dcp_load(self, path: str) -> None:
        msd, osd = get_state_dict(self.model, self.opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save_tp_and_interop(rank: int, world_size: int, root: str) -> dict:
    """2 dp x 2 tp. ours + TP: steps 0-1, save (save_checkpoint and plain DCP), steps 2-3. fully_shard + TP loads the
    plain DCP and takes steps 2-3. Then the other way: fully_shard + TP saves after steps 0-1 and goes on; ours + TP
    (the same model, already compiled) loads its checkpoint and takes steps 2-3."""
    out = {}
    ours = Run("ours", world_size)
    ours.steps(range(2))
    save_checkpoint(os.path.join(root, "ours-tp"), ours.model, ours.opt)
    ours.dcp_save(os.path.join(root, "ours-tp-dcp"))
    out["saved"], out["continued"] = ours.state(), ours.steps(range(2, 4))

    fsdp2 = Run("fsdp2", world_size)
    fsdp2.steps(range(1))  # creates the optimizer state to load into
    fsdp2.dcp_load(os.path.join(root, "ours-tp-dcp"))
    out["fsdp2_loaded"], out["fsdp2_losses"] = fsdp2.state(), fsdp2.steps(range(2, 4))

    fsdp2 = Run("fsdp2", world_size)
    fsdp2.steps(range(2))
    fsdp2.dcp_save(os.path.join(root, "fsdp2-tp-dcp"))
    out["fsdp2_saved"], out["fsdp2_continued"] = fsdp2.state(), fsdp2.steps(range(2, 4))
    ours.dcp_load(os.path.join(root, "fsdp2-tp-dcp"))  # the compiled model above: every value is overwritten
    out["ours_loaded"], out["ours_losses"] = ours.state(), ours.steps(range(2, 4))
    return out


def load_into_dp_only(rank: int, world_size: int, root: str) -> dict:
    """FSDP only on `world_size` ranks: load the 2x2 FSDP + TP checkpoint (load_checkpoint), save it again at once
    (save_checkpoint: the same values, now written by a 1-D layout), then steps 2-3."""
    run = Run("dp-only", world_size)
    run.steps(range(1))
    load_checkpoint(os.path.join(root, "ours-tp"), run.model, run.opt)
    loaded = run.state()
    save_checkpoint(os.path.join(root, "dp-only"), run.model, run.opt)
    return dict(loaded=loaded, losses=run.steps(range(2, 4)))


def load_back_into_tp(rank: int, world_size: int, root: str) -> dict:
    """2 dp x 2 tp again: ours + TP loads the FSDP-only checkpoint (load_checkpoint), then steps 2-3."""
    run = Run("ours", world_size)
    run.steps(range(1))
    load_checkpoint(os.path.join(root, "dp-only"), run.model, run.opt)
    return dict(loaded=run.state(), losses=run.steps(range(2, 4)))
