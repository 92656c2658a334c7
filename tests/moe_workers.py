"""Per-rank jobs for tests/test_moe.py: a small DeepSeek / Qwen3-style mixture-of-experts transformer under expert
parallelism, laid out as torchtitan lays it out, sharded once with `fully_shard` and once with fsdp2_compile.

4 ranks, every one data-parallel (its own batch): the experts' stacked weights are `Shard(0)` on the `ep` dim of a
(dp_shard_mod_ep=2, ep=2) mesh (`ExpertParallel`), tokens travel to the ranks that hold their experts and back by
all-to-all, the experts are sharded over `dp_shard_mod_ep` (`Shard(1)` when dp_shard_mod_ep x ep exceeds the number
of experts, as torchtitan chooses) and the rest of each block, then the root, over all 4 ranks. Routing has a fixed
capacity per expert, so every all-to-all moves equal splits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

import fsdp2_compile as fc
from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, collectives, compiled_graphs

DIM, HIDDEN, VOCAB, SEQ, BATCH, TOP_K, STEPS = 16, 32, 64, 8, 2, 2, 3


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs with stacked weights, run as one batched matmul over the experts this rank holds;
    input and output (experts, tokens, dim)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, HIDDEN, DIM) * DIM**-0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, HIDDEN, DIM) * DIM**-0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, DIM, HIDDEN) * HIDDEN**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        h = F.silu(torch.bmm(x, w1.transpose(1, 2))) * torch.bmm(x, w3.transpose(1, 2))
        return torch.bmm(h, w2.transpose(1, 2))


class ExpertParallel(ParallelStyle):
    """The experts' weights `Shard(0)` on the 1-D ep mesh; before the experts each rank's (experts, capacity, dim)
    tokens go to the ranks holding those experts, after them they come back (all-to-all, equal splits)."""

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    @staticmethod
    def _dispatch(module: nn.Module, inputs: tuple[torch.Tensor], mesh: DeviceMesh) -> torch.Tensor:
        (x,) = inputs
        experts, capacity, dim = x.shape
        ep = mesh.size()
        got = all_to_all_single_autograd(x.reshape(-1, dim), None, None, mesh)  # (ep sources x local experts x C)
        return got.view(ep, experts // ep, capacity, dim).transpose(0, 1).reshape(experts // ep, ep * capacity, dim)

    @staticmethod
    def _combine(module: nn.Module, y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        local, tokens, dim = y.shape
        ep = mesh.size()
        back = y.view(local, ep, tokens // ep, dim).transpose(0, 1).reshape(-1, dim)
        return all_to_all_single_autograd(back, None, None, mesh).view(local * ep, tokens // ep, dim)

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, mesh, self._partition, self._dispatch, self._combine)


class MoE(nn.Module):
    """Token-choice top-k routing (softmax scores, GShard's fixed capacity per expert: later tokens beyond it are
    dropped), routed experts, and a shared expert every token passes through."""

    def __init__(self, num_experts: int, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.router = nn.Linear(DIM, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts)
        self.shared = nn.Sequential(nn.Linear(DIM, HIDDEN, bias=False), nn.SiLU(), nn.Linear(HIDDEN, DIM, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, DIM)
        tokens, experts, capacity = x.shape[0], self.experts.num_experts, self.capacity
        weight, expert = self.router(x).softmax(-1).topk(TOP_K, dim=-1)  # (tokens, k)
        expert = expert.flatten()
        pos = (F.one_hot(expert, experts).cumsum(0) - 1).gather(1, expert[:, None]).squeeze(1)  # place in its queue
        slot = torch.where(pos < capacity, expert * capacity + pos, experts * capacity)  # overflow: a dropped slot
        one_hot = F.one_hot(slot, experts * capacity + 1)[:, :-1].to(x.dtype).view(tokens, TOP_K, -1)
        dispatch, combine = one_hot.sum(1), (one_hot * weight[..., None]).sum(1)  # (tokens, experts x capacity)
        routed = self.experts((dispatch.t() @ x).view(experts, capacity, DIM)).reshape(experts * capacity, DIM)
        return (combine @ routed + self.shared(x)).view(shape)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, DIM // 2).transpose(1, 3).unbind(2)  # 2 heads
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, DIM))


class Block(nn.Module):
    def __init__(self, num_experts: int, capacity: int):
        super().__init__()
        self.attn_norm, self.moe_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attn = Attention()
        self.moe = MoE(num_experts, capacity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoETransformer(nn.Module):
    def __init__(self, num_experts: int, n_layers: int = 2):
        super().__init__()
        capacity = BATCH * SEQ * TOP_K // num_experts  # capacity factor 1
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(num_experts, capacity) for _ in range(n_layers))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _parallelize(system: str, model: MoETransformer, mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
    """torchtitan's order: expert parallelism on the experts, then FSDP: each block's experts over dp_shard_mod_ep
    (gradients divided by the whole dp size, as the tokens they saw came from every dp rank), each block over dp,
    the root last."""
    shard = fully_shard if system == "fsdp2" else fc.shard
    for block in model.layers:
        experts = block.moe.experts
        parallelize_module(experts, mesh["ep"], ExpertParallel())
        over = mesh["dp_shard_mod_ep"]
        dim = 1 if over.size() * mesh["ep"].size() > experts.num_experts else 0
        shard(experts, mesh=over, shard_placement_fn=lambda p, dim=dim: Shard(dim))
        experts.set_gradient_divide_factor(dp_mesh.size())
        experts.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum: sum, then divide
        shard(block, mesh=dp_mesh)
    if system == "fsdp2":
        fully_shard(model, mesh=dp_mesh)
    else:
        fc.shard_compile(model, dp_mesh)


def moe_training(rank: int, world_size: int) -> dict:
    """Per number of experts (4: `Shard(0)` over dp_shard_mod_ep; 2: `Shard(1)`), per system: the losses of
    `STEPS` AdamW steps, every parameter in full after them, the experts' placements, and (ours) the collectives
    of each compiled graph."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    dp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    out = {}
    for num_experts in (4, 2):
        for system in ("fsdp2", "ours"):
            clear_compiled_graphs()
            torch.manual_seed(0)
            model = MoETransformer(num_experts)
            _parallelize(system, model, mesh, dp_mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(100 + rank)
            losses = []
            for _ in range(STEPS):
                tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen)
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            params = dict(model.named_parameters())
            w1 = params["layers.0.moe.experts.w1"]
            out[(num_experts, system)] = {
                "losses": losses,
                "params": {n: p.full_tensor() for n, p in params.items()},
                "experts": (w1.device_mesh.mesh_dim_names, tuple(str(p) for p in w1.placements)),
                "graphs": [(r.kind, [(c.kind, bool(c.params)) for c in collectives(r.gm)]) for r in compiled_graphs()],
            }
    return out
