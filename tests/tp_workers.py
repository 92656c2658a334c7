"""Per-rank jobs for tests/test_tensor_parallel.py: FSDP + tensor parallelism on a (dp, tp) mesh, the same TP plan
under `fully_shard` and under `shard_compile`, and the single-process reference they are both compared with."""

from __future__ import annotations

import torch
import torch.distributed as dist
from models import GPT_CFG, batch, local_slice, loss_fn, make_model
from real_model_workers import hf_model, token_batch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import fsdp2_compile as fc
from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, collectives, compiled_graphs

STEPS = 3
LLAMA_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}
GPT_PLAN = {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
"""The GPT's MLPs; its attention keeps one fused qkv projection, which ColwiseParallel cannot split per head."""
LLAMA_SP_PLAN = {
    "input_layernorm": SequenceParallel(),
    "self_attn": PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
    ),
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
    "post_attention_layernorm": SequenceParallel(),
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
}
"""HF Llama with sequence-parallel norms: between the layers' matmuls the activations are split on the sequence."""


def _llama_sequence_parallel(model, layers, tp_mesh) -> None:
    """LLAMA_SP_PLAN on every layer. HF derives the rotary positions from the embedding output's length, so the
    embedding stays whole and layer 0 splits its input on the sequence; the final norm is sequence-parallel and
    the (tied, whole) head gathers the sequence back."""
    for layer in layers:
        parallelize_module(layer, tp_mesh, LLAMA_SP_PLAN)
    parallelize_module(
        layers[0],
        tp_mesh,
        PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True),
    )
    parallelize_module(model.model.norm, tp_mesh, SequenceParallel())
    parallelize_module(
        model.lm_head,
        tp_mesh,
        PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
    )


def build(name: str, system: str, mesh=None, param_dtype=None):
    """The model and its blocks, TP plan applied on mesh["tp"], then sharded over mesh["dp"] (per block, then the
    root) by `fully_shard` ("fsdp2") or `shard` / `shard_compile` ("ours"); unsharded without a mesh."""
    if name in ("llama", "llama-sp"):
        model, layers = hf_model("llama")
        plan = LLAMA_PLAN
    else:
        model = make_model("gpt")
        layers, plan = model.blocks, GPT_PLAN
    if mesh is None:
        return model
    if name == "llama-sp":
        _llama_sequence_parallel(model, layers, mesh["tp"])
    else:
        for layer in layers:
            parallelize_module(layer, mesh["tp"], plan)
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
        for layer in layers:
            fully_shard(layer, mesh=mesh["dp"], mp_policy=mp)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    else:
        mp = fc.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
        for layer in layers:
            fc.shard(layer, mesh["dp"], mp_policy=mp)
        fc.shard_compile(model, mesh["dp"], mp_policy=mp)
    return model


def step_loss(name: str, model, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    if name in ("llama", "llama-sp"):
        ids = local_slice(token_batch(step), dp_rank, dp_size)
        return model(input_ids=ids, labels=ids).loss
    x, y = batch("gpt", step)
    return loss_fn("gpt", model(local_slice(x, dp_rank, dp_size)), local_slice(y, dp_rank, dp_size))


def train(name: str, model, dp_rank: int = 0, dp_size: int = 1) -> tuple[list[float], dict]:
    """STEPS AdamW steps; the losses (averaged over the dp ranks) and the first step's full gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = step_loss(name, model, step, dp_rank, dp_size)
        loss.backward()
        if step == 0:
            grads = {
                k: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float().clone()
                for k, p in model.named_parameters()
            }
        opt.step()
        opt.zero_grad()
        loss = loss.detach().float().clone()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses, grads


def tp_parity(rank: int, world_size: int, name: str, param_dtype=None) -> dict:
    """2 dp x 2 tp: losses and first-step gradients of fully_shard + TP and of ours + TP; our placements, bytes
    held per rank, and the collectives of our graphs (FSDP's by kind; TP's counted apart)."""
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    out = {}
    for system in ("fsdp2", "ours"):
        clear_compiled_graphs()
        model = build(name, system, mesh, param_dtype)
        out[system] = train(name, model, dp_rank, dp_size)
        if system == "ours":
            out["placements"] = {
                k: (p.device_mesh.mesh_dim_names, tuple(map(str, p.placements))) for k, p in model.named_parameters()
            }
            out["sizes"] = [
                (p.numel(), p.to_local().numel(), any(pl.is_shard() for pl in p.placements[1:]))
                for p in model.parameters()
            ]
            out["graphs"] = [(r.kind, [(c.kind, bool(c.params)) for c in collectives(r.gm)]) for r in compiled_graphs()]
        else:
            out["fsdp2_placements"] = {
                k: (p.device_mesh.mesh_dim_names, tuple(map(str, p.placements))) for k, p in model.named_parameters()
            }
    return out


def tp_parity_dtypes(rank: int, world_size: int, name: str, dtypes: tuple) -> dict:
    """`tp_parity` for each param dtype, in one set of processes (by `str(dtype)`)."""
    return {str(dtype): tp_parity(rank, world_size, name, dtype) for dtype in dtypes}


def reference(name: str) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    return train(name, build(name, "none"))


__all__ = ["GPT_CFG", "reference", "tp_parity", "tp_parity_dtypes"]
