"""Per-rank jobs for tests/test_float8.py: the GPT with torchao's float8 training (`Float8Linear` layers, emulated
on the CPU) and FSDP2's float8 all-gather, sharded per block and at the root with `fully_shard` or fsdp2_compile."""

from __future__ import annotations

import warnings

import torch
from models import GLOBAL_BATCH, GPT, GPT_CFG, gpt_loss, make_batch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp2_compile as fc
from fsdp2_compile.compiler import graph_records

STEPS = 3


def _float8_gpt():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    # the head is tied to the embedding and stays high-precision (as torchtitan leaves the output layer)
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn != "lm_head")


def _train(system: str, bf16: bool, precompute: bool, rank: int, world_size: int) -> dict:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    mesh = init_device_mesh("cpu", (world_size,))
    model = _float8_gpt()
    if system == "fsdp2":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **({"mp_policy": mp} if mp else {}))
        fully_shard(model, mesh=mesh, **({"mp_policy": mp} if mp else {}))
    else:
        mp = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        for block in model.blocks:
            fc.shard(block, mesh, **({"mp_policy": mp} if mp else {}))
        model = fc.shard_compile(model, mesh, **({"mp_policy": mp} if mp else {}))
        graph_records.clear_compiled_graphs()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        idx, targets = make_batch(GPT_CFG, GLOBAL_BATCH, GPT_CFG.block_size, seed=step)
        local = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
        loss = gpt_loss(model(idx[local]), targets[local])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    out = {"losses": losses, "params": {k: p.full_tensor() for k, p in model.named_parameters()}}
    if system == "ours":
        out["gathers"] = [
            (c.params, c.dtype, c.nbytes)
            for record in graph_records.compiled_graphs()
            for c in graph_records.collectives(record.gm)
            if c.kind.value == "all_gather"
        ]
    return out


def float8_training(rank: int, world_size: int) -> dict:
    warnings.filterwarnings("ignore", module="torchao")
    return {
        (system, bf16): _train(system, bf16, precompute=system == "fsdp2", rank=rank, world_size=world_size)
        for bf16 in (False, True)
        for system in ("fsdp2", "ours")
    }
