"""Per-rank jobs for tests/test_tp_plans.py: torchtitan's sequence-parallel Llama plan with `loss_parallel` on a
2 dp x 2 tp mesh, and HSDP + TP on a 2 x 2 x 2 (replicate, shard, tp) mesh; each under `fully_shard` and under
`shard` / `shard_compile`, and their single-process references."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import local_slice
from real_model_workers import hf_model, token_batch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
from tp_workers import LLAMA_PLAN

import fsdp2_compile as fc

MAX_NORM = 0.5  # small enough that clip_grad_norm_ clips


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _shard_all(model, layers, system: str, dp_mesh, config: fc.CompileConfig = fc.CompileConfig()) -> None:
    """Per block, then the root, over `dp_mesh` (1-D, or 2-D (replicate, shard) for HSDP)."""
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    else:
        for layer in layers:
            fc.shard(layer, dp_mesh)
        fc.shard_compile(model, dp_mesh, compile_config=config)


def _tt_loss(model, step: int, dp_rank: int, dp_size: int, parallel: bool) -> torch.Tensor:
    ids = local_slice(token_batch(step, seq=17), dp_rank, dp_size)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _train_tt(model, dp_rank: int, dp_size: int, steps: int, parallel: bool) -> dict:
    """AdamW steps with clip_grad_norm_; the loss (under loss_parallel when the logits are vocab-sharded) and its
    backward both inside the context, as torchtitan does. Returns losses (averaged over ranks), total norms, the
    first step's full gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = dict(losses=[], norms=[], grads={})
    for step in range(steps):
        with loss_parallel() if parallel else torch.enable_grad():
            loss = _tt_loss(model, step, dp_rank, dp_size, parallel)
            loss.backward()
        if step == 0:
            out["grads"] = {k: _full(p.grad).clone() for k, p in model.named_parameters()}
        out["norms"].append(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)).item())
        opt.step()
        opt.zero_grad()
        loss = _full(loss).detach().clone()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        out["losses"].append(loss.item())
    out["opt"] = opt
    return out


def sequence_parallel(rank: int, world_size: int, steps: int = 3) -> dict:
    """2 dp x 2 tp, torchtitan's plan (tests/tt_llama.py) with loss_parallel: fully_shard and ours. Besides the
    training figures: state_dict() and the optimizer state (placements and full values) after the last step."""
    from tt_llama import Llama, parallelize

    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    result = {}
    for system in ("fsdp2", "ours"):
        model = parallelize(Llama(), mesh["tp"])
        _shard_all(model, model.layers, system, mesh["dp"], fc.CompileConfig())
        out = _train_tt(model, dp_rank, dp_size, steps, parallel=True)
        opt = out.pop("opt")
        out["state_dict"] = {
            k: (tuple(map(str, v.placements)), _full(v).clone()) for k, v in model.state_dict().items()
        }
        names = {id(p): k for k, p in model.named_parameters()}
        out["optim"] = {
            f"{names[id(p)]}.{s}": (tuple(map(str, v.placements)) if isinstance(v, DTensor) else (), _full(v).clone())
            for p, st in opt.state.items()
            for s, v in st.items()
        }
        result[system] = out
    return result


def tt_reference(steps: int = 3) -> dict:
    from tt_llama import Llama

    out = _train_tt(Llama(), 0, 1, steps, parallel=False)
    out.pop("opt")
    return out


def hsdp_tp(rank: int, world_size: int, steps: int = 2) -> dict:
    """(replicate, shard, tp) = 2 x 2 x 2: HF Llama, the plan of tests/tp_workers.py on mesh["tp"], sharded over
    mesh["replicate", "shard"]; fully_shard and ours. Losses, first-step gradients, placements."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp_mesh = mesh["replicate", "shard"]
    dp_rank = mesh["replicate"].get_local_rank() * 2 + mesh["shard"].get_local_rank()
    result = {}
    for system in ("fsdp2", "ours"):
        model, layers = hf_model("llama")
        for layer in layers:
            parallelize_module(layer, mesh["tp"], LLAMA_PLAN)
        _shard_all(model, layers, system, dp_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], {}
        for step in range(steps):
            ids = local_slice(token_batch(step), dp_rank, 4)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if step == 0:
                grads = {k: _full(p.grad).clone() for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            losses.append(loss.item() / world_size)
        placements = {
            k: (p.device_mesh.mesh_dim_names, tuple(map(str, p.placements))) for k, p in model.named_parameters()
        }
        result[system] = dict(losses=losses, grads=grads, placements=placements)
    return result


def hsdp_reference(steps: int = 2) -> tuple[list[float], dict]:
    model, _ = hf_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for step in range(steps):
        ids = token_batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads
