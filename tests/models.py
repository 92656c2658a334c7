"""Models, data and the single-process reference trainer the distributed tests compare against."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, Block, GPTConfig, gpt_loss, make_batch  # noqa: E402, F401 (Block: for the pipeline workers)

GPT_CFG = GPTConfig(vocab_size=98, block_size=16, n_layer=2, n_head=2, d_model=32)
GLOBAL_BATCH = 8
SEQ = 16


class MLP(nn.Module):
    """Awkward on purpose: dim 0 of 33 (not divisible by 2 or 4), 3 and 1 (smaller than the world size),
    a frozen layer, a buffer and a (frozen) parameter meant for `ignored_params`."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.fc1 = nn.Linear(16, 33)
        self.norm = nn.LayerNorm(33)
        self.fc2 = nn.Linear(33, 3)
        self.head = nn.Linear(3, 1)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16), requires_grad=False)
        self.register_buffer("shift", torch.linspace(-1, 1, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(x + self.shift) * self.scale
        return self.head(F.relu(self.fc2(self.norm(F.relu(self.fc1(h))))))


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MLP() if name == "mlp" else GPT(GPT_CFG)


def batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (inputs, targets)."""
    if name == "mlp":
        g = torch.Generator().manual_seed(100 + step)
        return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)
    return make_batch(GPT_CFG, GLOBAL_BATCH, SEQ, seed=100 + step)


def loss_fn(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target) if name == "mlp" else gpt_loss(out.float(), target)


def local_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    n = t.shape[0] // world_size
    return t[rank * n : (rank + 1) * n]


def make_optimizer(model: nn.Module, foreach: bool | None = None) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=foreach)


def reference_train(
    name: str, steps: int, world_size: int = 1, param_dtype: torch.dtype | None = None, clip: float | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the global batch. With `param_dtype`, it applies FSDP's casts: fp32 master
    weights, forward/backward on a `param_dtype` copy, each of the `world_size` local batches' gradients cast to
    fp32 and averaged — what sharded mixed precision computes, without any sharding."""
    model = make_model(name)
    opt = make_optimizer(model)
    losses = []
    for step in range(steps):
        x, y = batch(name, step)
        if param_dtype is None:
            loss = loss_fn(name, model(x), y)
            loss.backward()
            losses.append(loss.item())
        else:
            low = copy.deepcopy(model).to(param_dtype)
            step_loss = 0.0
            for r in range(world_size):
                low.zero_grad()
                loss = loss_fn(name, low(local_slice(x, r, world_size)), local_slice(y, r, world_size))
                loss.backward()
                step_loss += loss.item() / world_size
                for p, q in zip(model.parameters(), low.parameters()):
                    if q.grad is not None:
                        g = q.grad.float() / world_size
                        p.grad = g if p.grad is None else p.grad + g
            losses.append(step_loss)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}
