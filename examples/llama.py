"""A Llama-style decoder (RMSNorm, rotary position embedding, grouped-query attention, SwiGLU MLP, untied lm head)
and factories with the shapes of Llama-3-8B, Llama-3-70B and Llama-3.1-405B, built on the meta device (no memory used).

The factories follow the `fsdp2-compile` TARGET convention: they return `(model, args, loss_fn)`, and accept
`layers=` so the planner can compile a reduced copy with the same widths and scale by the layer count. Their
`tp_plan` / `tp_root_plan` are torchtitan's Llama plan (`--tp`): sequence-parallel norms, the activations gathered
before attention and the MLP and reduce-scattered after, a vocab-parallel embedding and a column-wise head whose
logits stay vocab-sharded (loss parallel):

    fsdp2-compile plan examples/llama.py:llama3_70b --world-size 1024
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    n_layers: int = 32
    d_model: int = 4096
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5


LLAMA3_8B = LlamaConfig()
LLAMA3_70B = LlamaConfig(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672)
# torchtitan's 405B: ffn 4096 x ceil(1.2 x int(2/3 x 4 x 16384) / 4096) (ffn_dim_multiplier 1.2, multiple_of 4096)
LLAMA3_405B = LlamaConfig(n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, ffn_dim=53248)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of `x` [batch, heads, seq, head_dim] (rotate-half form)."""
    seq, half = x.shape[2], x.shape[3] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention: `n_kv_heads` key/value heads shared by groups of query heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        head_dim = cfg.d_model // cfg.n_heads
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        cfg, head_dim = self.cfg, self.cfg.d_model // self.cfg.n_heads
        # head counts from the projections (-1), not the config: under tensor parallelism each rank's column-wise
        # q/k/v hold only its heads
        q = self.wq(x).view(b, t, -1, head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, head_dim).transpose(1, 2)
        q, k = rotate(q, cfg.rope_theta), rotate(k, cfg.rope_theta)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def next_token_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the input shifted by one (the targets do not matter for planning)."""
    targets = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build(cfg: LlamaConfig, layers: int | None = None, batch: int = 1, seq: int = 2048, device: str = "meta"):
    """(model, (tokens,), loss_fn) for `cfg`, with `layers` blocks instead of `cfg.n_layers` if given."""
    cfg = replace(cfg, n_layers=cfg.n_layers if layers is None else layers)
    with torch.device(device):
        model = Llama(cfg)
        tokens = torch.zeros(batch, seq, dtype=torch.long)
    return model, (tokens,), next_token_loss


def tp_plan(block: Block) -> dict:
    """torchtitan's per-block TP plan (parallelize_llama.apply_tp) in this model's names."""
    seq, whole = Shard(1), Replicate()
    return {
        "attn_norm": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=seq),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
        "mlp.w1": ColwiseParallel(),
        "mlp.w3": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=seq),
    }


TP_ROOT_PLAN = {
    "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1)),
}
"""torchtitan's plan of the modules outside the blocks; the head's logits stay vocab-sharded (as under
`loss_parallel`, whose all-reduces of per-token max and sum are a few bytes a token)."""


def llama3_8b(layers: int | None = None, batch: int = 1, seq: int = 2048):
    """Llama-3-8B shapes: 32 layers, d 4096, 32 query / 8 key-value heads, SwiGLU 14336, vocab 128256."""
    return build(LLAMA3_8B, layers, batch, seq)


def llama3_70b(layers: int | None = None, batch: int = 1, seq: int = 2048):
    """Llama-3-70B shapes: 80 layers, d 8192, 64 query / 8 key-value heads, SwiGLU 28672, vocab 128256."""
    return build(LLAMA3_70B, layers, batch, seq)


def llama3_405b(layers: int | None = None, batch: int = 1, seq: int = 2048):
    """Llama-3.1-405B shapes: 126 layers, d 16384, 128 query / 8 key-value heads, SwiGLU 53248, vocab 128256."""
    return build(LLAMA3_405B, layers, batch, seq)


for _factory in (llama3_8b, llama3_70b, llama3_405b):
    _factory.tp_plan, _factory.tp_root_plan = tp_plan, TP_ROOT_PLAN


LLAMA_TINY = LlamaConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=160)


def llama_tiny(layers: int | None = None, batch: int = 2, seq: int = 16):
    """A 2-layer Llama with real (CPU) weights, small enough to dump in seconds."""
    torch.manual_seed(0)
    return build(LLAMA_TINY, layers, batch, seq, device="cpu")
