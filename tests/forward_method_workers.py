"""Per-rank jobs for tests/test_forward_methods.py: a method other than `forward` registered with FSDP2's
`register_fsdp_forward_method` on `fully_shard` and with ours on `shard_compile`, trained the same way."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import fsdp2_compile as fc


class Features(nn.Module):
    """Blocks sharded on their own around the root's own `inp`, which `features` uses twice: its input must be cast
    by the root's policy, and `inp` gathered once for the call, so that its two gradients are summed before one
    reduction (as FSDP2 unshards a group once per forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 1)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.inp(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def forward_method(rank: int, world_size: int, bf16: bool) -> dict:
    """Each system's losses of 3 AdamW steps on `model.features(x)` and its parameters after them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    out = {}
    for system in ("fsdp2", "ours"):
        torch.manual_seed(0)
        model = Features()
        if system == "fsdp2":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            register_fsdp_forward_method(model, "features")
        else:
            mp = fc.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
            for block in model.blocks:
                fc.shard(block, mp_policy=mp)
            fc.shard_compile(model, mp_policy=mp)
            fc.register_fsdp_forward_method(model, "features")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
            loss = model.features(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[system] = {
            "losses": losses,
            "params": {n: p.full_tensor() for n, p in model.named_parameters() if not n.startswith("head.")},
        }
    return out
