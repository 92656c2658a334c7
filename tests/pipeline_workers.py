"""Per-rank jobs for tests/test_pipeline.py: a GPT cut into pipeline stages (torchtitan's way: the whole model built
on every rank, then each stage keeps its layers), each stage sharded over the dp slice of a (pp, dp) mesh with
`fully_shard` or with fsdp2_compile, and driven by torch's pipelining schedules."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from models import GPT_CFG, Block, make_batch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor.parallel import parallelize_module
from tp_workers import GPT_PLAN

import fsdp2_compile as fc

MICROBATCHES = 4
BATCH = 8
"""Samples per dp rank and step (four micro-batches of two)."""
STEPS = 2


class StagedGPT(nn.Module):
    """The GPT of examples/gpt.py as a pipeline stage: embeddings on the first, the final norm and an (untied) head
    on the last, blocks in a `ModuleDict` keyed by their index in the whole model."""

    def __init__(self, n_layer: int):
        super().__init__()
        cfg = GPT_CFG
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(n_layer)})
        self.norm = nn.LayerNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            h = self.tok_emb(h) + self.pos_emb(torch.arange(h.shape[1], device=h.device))
        for layer in self.layers.values():
            h = layer(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def stage_module(whole: StagedGPT, stage: int, stages: int) -> StagedGPT:
    """Stage `stage` of `stages`: a copy of `whole` keeping its share of the layers."""
    module = copy.deepcopy(whole)
    per_stage = len(whole.layers) // stages
    keep = {str(i) for i in range(stage * per_stage, (stage + 1) * per_stage)}
    for name in list(module.layers):
        if name not in keep:
            del module.layers[name]
    if stage != 0:
        module.tok_emb = module.pos_emb = None
    if stage != stages - 1:
        module.norm = module.output = None
    return module


def _collective_counts(prof) -> dict[str, int]:
    """How many times each reducing collective ran in `prof` (a `torch.profiler.profile`), by event name."""
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name in ("gloo:all_reduce", "gloo:all_to_all", "gloo:reduce_scatter"):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def _example_io(stage: int, stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's input and output of stage `stage` (static shapes: the schedule infers none at run time)."""
    mb, seq, cfg = BATCH // MICROBATCHES, 16, GPT_CFG
    hidden = torch.empty(mb, seq, cfg.d_model, requires_grad=True)
    first = torch.zeros(mb, seq, dtype=torch.long)
    last = torch.empty(mb, seq, cfg.vocab_size)
    return (first if stage == 0 else hidden), (last if stage == stages - 1 else hidden)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


def _shard(system: str, module: nn.Module, mesh, tp_mesh) -> None:
    shard = torch.distributed.fsdp.fully_shard if system == "fsdp2" else fc.shard
    for layer in module.layers.values():
        if tp_mesh is not None:
            parallelize_module(layer, tp_mesh, GPT_PLAN)
        shard(layer, mesh=mesh)
    if system == "fsdp2":
        torch.distributed.fsdp.fully_shard(module, mesh=mesh)
    else:
        fc.shard_compile(module, mesh)


def pipelined_training(rank: int, world_size: int, schedule: str, tp: int = 1) -> dict:
    """Train the staged GPT for `STEPS` steps on a (pp=2, dp, tp) mesh with `schedule` ("gpipe", "1f1b", or
    "interleaved": two stages per rank), once with `fully_shard` and once with fsdp2_compile; with `tp` > 1 the
    layers' MLPs are tensor-parallel first (`tp_workers.GPT_PLAN`). Returns, per system, the last stage's losses,
    every stage parameter in full after training, and how many reducing gloo collectives each rank issued in the
    last step."""
    pp, dp = 2, world_size // (2 * tp)
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    tp_mesh = mesh["tp"] if tp > 1 else None
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    per_rank = 2 if schedule == "interleaved" else 1
    stages = pp * per_rank
    torch.manual_seed(0)
    whole = StagedGPT(n_layer=stages)
    out = {}
    for system in ("fsdp2", "ours"):
        indices = [pp_rank + k * pp for k in range(per_rank)]
        modules = [stage_module(whole, i, stages) for i in indices]
        for module in modules:
            _shard(system, module, mesh["dp"], tp_mesh)
        pipeline_stages = [
            PipelineStage(m, i, stages, torch.device("cpu"), *_example_io(i, stages), group=mesh["pp"].get_group())
            for m, i in zip(modules, indices)
        ]
        if schedule == "interleaved":
            runner = ScheduleInterleaved1F1B(pipeline_stages, MICROBATCHES, loss_fn=_loss)
        else:
            kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            runner = kind(pipeline_stages[0], MICROBATCHES, loss_fn=_loss)
        params = [p for m in modules for p in m.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-2)
        losses, counts = [], {}
        for step in range(STEPS):
            x, y = make_batch(GPT_CFG, BATCH * dp, 16, seed=100 + step)
            x, y = x[dp_rank * BATCH : (dp_rank + 1) * BATCH], y[dp_rank * BATCH : (dp_rank + 1) * BATCH]
            step_losses = []
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                args = (x,) if 0 in indices else ()
                if stages - 1 in indices:
                    runner.step(*args, target=y, losses=step_losses)
                else:
                    runner.step(*args)
            counts = _collective_counts(prof)
            opt.step()
            opt.zero_grad()
            losses.append([loss.item() for loss in step_losses])
        out[system] = {
            "losses": losses,
            "params": {f"{i}.{n}": p.full_tensor() for m, i in zip(modules, indices) for n, p in m.named_parameters()},
            "reductions": counts,
        }
    return out
