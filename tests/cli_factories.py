"""Model factories for tests/test_cli.py, in the `fsdp2-compile` TARGET convention."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.fc(self.norm(x)))


class Tiny(nn.Module):
    def __init__(self, d: int = 16, layers: int = 2, vocab: int = 33, out: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, out)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tiny():
    """Real CPU weights, default loss (sum of the output)."""
    torch.manual_seed(0)
    return Tiny(), (torch.randint(0, 33, (2, 4)),)


def wide_meta(layers: int | None = None):
    """On the meta device, wide enough that padding is small at 1024 ranks; takes `layers=` for the planner."""
    with torch.device("meta"):
        model = Tiny(d=4096, layers=3 if layers is None else layers, vocab=1000, out=2048)
        idx = torch.zeros(1, 8, dtype=torch.long)
    return model, (idx,), lambda out: out.float().sum()


def raises():
    raise ValueError("boom from the factory")


def wrong_return():
    return nn.Linear(2, 2)


def wrong_model():
    return "not a module", (torch.zeros(1),)
