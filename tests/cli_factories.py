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


def needs_width(width: int):
    return nn.Linear(width, width), (torch.zeros(1, width),)


def no_parameters():
    return nn.ReLU(), (torch.zeros(1, 2),)


def llama3_70b_plain(batch: int = 1, seq: int = 2048):
    """Llama-3-70B shapes on the meta device, WITHOUT a `layers=` argument: the planner cuts the block list itself."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from llama import LLAMA3_70B, build

    return build(LLAMA3_70B, None, batch, seq)


def tiny_plain_meta():
    """`Tiny` on the meta device with 4 blocks and no `layers=` argument (the planner cuts its block list)."""
    with torch.device("meta"):
        model = Tiny(d=64, layers=4, vocab=100, out=32)
        idx = torch.zeros(2, 8, dtype=torch.long)
    return model, (idx,), lambda out: out.float().sum()


def gpt_bench(batch: int = 4, seq: int = 256):
    """The GPT of benchmarks/step_time.py (8 layers, d 512, 8 heads, vocab 8192, seq 256) with one rank's share of
    its global batch of 8 at 2 ranks, on the meta device; no `layers=`."""
    import os
    import sys

    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=8192, block_size=seq, n_layer=8, n_head=8, d_model=512))
        idx = torch.zeros(batch, seq, dtype=torch.long)

    def loss(logits):
        targets = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return model, (idx,), loss


class TPBlock(nn.Module):
    """norm -> up_proj -> relu -> down_proj, residual: named so the default TP plan splits up column-wise and down
    row-wise (one all-reduce of the activations per block in forward, one in backward)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return x + self.down_proj(torch.relu(self.up_proj(self.norm(x))))


class TPStack(nn.Module):
    def __init__(self, d: int = 16, hidden: int = 64, layers: int = 2, vocab: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(TPBlock(d, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tp_mlp(layers: int = 2):
    """`TPStack` (d 16, hidden 64, vocab 32) on the meta device, tokens (2, 8); for `--tp` (default TP plan)."""
    with torch.device("meta"):
        model = TPStack(layers=layers)
        idx = torch.zeros(2, 8, dtype=torch.long)
    return model, (idx,), lambda out: out.float().sum()


def tp_mlp_real():
    """`TPStack` with real CPU weights (for `dump --tp`)."""
    torch.manual_seed(0)
    return TPStack(), (torch.randint(0, 32, (2, 8)),)


def tp_mlp_sequence_parallel(layers: int = 2):
    """`TPStack` with its own TP plan: sequence parallel norms, the activations all-gathered before up_proj and
    reduce-scattered after down_proj (torchtitan's layout)."""
    return tp_mlp(layers)


def _sequence_parallel_plan(block):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "norm": SequenceParallel(),
        "up_proj": ColwiseParallel(input_layouts=Shard(1)),
        "down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


tp_mlp_sequence_parallel.tp_plan = _sequence_parallel_plan


def llama_small(layers: int | None = None, batch: int = 1, seq: int = 32, device: str = "meta"):
    """A 4-block Llama (d 96, 4 query / 2 key-value heads, vocab 1000), on the meta device unless `device` says
    otherwise: the search's test model (`layers=` and `batch=`; a vocabulary that pads at 3 or 6 ranks)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from llama import LlamaConfig, build

    cfg = LlamaConfig(vocab_size=1000, n_layers=4, d_model=96, n_heads=4, n_kv_heads=2, ffn_dim=200)
    return build(cfg, layers, batch, seq, device)
