"""Per-rank jobs for tests/test_dropless_moe.py: a dropless mixture-of-experts transformer written as torchtitan
writes it (`torchtitan/models/moe/moe.py`, `torchtitan/distributed/expert_parallel.py`), under expert parallelism,
sharded once with `fully_shard` and once with fsdp2_compile.

Dropless: every token reaches its top-k experts, however many pick the same one. Each MoE layer routes with sigmoid
scores (plus the load-balancing bias, for choosing only), counts its tokens per expert (`torch.histc`), and its
`ExpertParallel` style exchanges those counts with an `all_to_all_single`, turns them into Python split sizes
(`.tolist()`), sends the tokens to the ranks holding their experts with a variable-split all-to-all, permutes them so
each local expert gets a contiguous run, runs each expert on its run (a loop over `torch.split`), and undoes all of
it on the way back. A shared expert sees every token. Load balancing is auxiliary-loss-free: a `tokens_per_expert`
buffer counts the routed tokens outside autograd, and an optimizer step pre-hook sums it over the dp ranks and moves
the `expert_bias` buffer towards the less loaded experts.

Layout (torchtitan's): the experts' stacked weights `Shard(0)` on `ep` of a (dp_shard_mod_ep, ep) mesh, sharded over
dp_shard_mod_ep; attention, router, shared expert and the root over all dp ranks, each rank with its own batch."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

import fsdp2_compile as fc
from fsdp2_compile.compiler.graph_records import clear_compiled_graphs, collectives, compile_counts, compiled_graphs

DIM, HIDDEN, VOCAB, SEQ, BATCH, TOP_K, EXPERTS, STEPS = 16, 32, 64, 8, 2, 2, 4, 3
BIAS_RATE = 0.05
"""The load-balancing bias's step (torchtitan's `load_balance_coeff`), large so that routing moves every step."""


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs with stacked weights; `forward(x, num_tokens_per_expert)` runs expert i on the i-th
    run of `x`'s rows, one matmul chain per expert (grouped GEMM is GPU-only)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, HIDDEN, DIM) * DIM**-0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, HIDDEN, DIM) * DIM**-0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, DIM, HIDDEN) * HIDDEN**-0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: list[int]) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        out = []
        for i, x_expert in enumerate(torch.split(x, num_tokens_per_expert, dim=0)):
            h = F.silu(x_expert @ w1[i].t()) * (x_expert @ w3[i].t())
            out.append(h @ w2[i].t())
        return torch.cat(out, dim=0)


class ExpertParallel(ParallelStyle):
    """The experts' weights `Shard(0)` on the 1-D ep mesh. Before the experts: the counts per expert go to the ranks
    holding those experts (all-to-all), become split sizes, the tokens follow (variable-split all-to-all) and are
    permuted from (source rank, expert) order to (expert, source rank); after them, the reverse.
    `exchange_counts=False`: a broken variant that skips the exchange, assuming every rank sends what it receives."""

    def __init__(self, exchange_counts: bool = True):
        super().__init__()
        self.exchange_counts = exchange_counts

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        routed_input, num_tokens_per_expert = inputs
        ep = mesh.size()
        local = num_tokens_per_expert.numel() // ep
        with torch.no_grad():
            received = (  # (source rank, expert)
                all_to_all_single(num_tokens_per_expert, None, None, mesh).wait()
                if self.exchange_counts
                else num_tokens_per_expert
            )
            counts = torch.cat([num_tokens_per_expert, received]).tolist()  # one device-to-host sync
        sent, received = counts[: ep * local], counts[ep * local :]
        self.input_splits = [sum(sent[r * local : (r + 1) * local]) for r in range(ep)]
        self.output_splits = [sum(received[r * local : (r + 1) * local]) for r in range(ep)]
        routed_input = all_to_all_single_autograd(routed_input, self.output_splits, self.input_splits, mesh)
        # each received token's local expert, then a stable sort by it: every expert's tokens contiguous
        expert_of = torch.arange(ep * local).remainder(local)
        expert_of = expert_of.repeat_interleave(torch.tensor(received), output_size=sum(received))
        self.permutation = torch.argsort(expert_of, stable=True)
        per_expert = [sum(received[r * local + e] for r in range(ep)) for e in range(local)]
        return routed_input[self.permutation], per_expert

    def _combine(self, module: nn.Module, routed_output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        unpermuted = torch.empty_like(routed_output)
        unpermuted[self.permutation] = routed_output
        return all_to_all_single_autograd(unpermuted, self.input_splits, self.output_splits, mesh)

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, mesh, self._partition, self._dispatch, self._combine)


class TokenChoiceTopKRouter(nn.Module):
    """Sigmoid scores; the top-k experts by score plus `expert_bias` (the bias chooses, it does not weigh); the
    chosen scores normalised to sum to 1; the number of tokens each expert got."""

    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(DIM, num_experts, bias=False)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.gate(x).float())
        _, selected = torch.topk(scores + expert_bias, k=self.top_k, dim=1)
        top_scores = scores.gather(1, selected)
        top_scores = top_scores / top_scores.sum(-1, keepdim=True)
        counts = torch.histc(selected.view(-1).float(), bins=self.num_experts, min=0, max=self.num_experts)
        return top_scores, selected, counts.long()


class MoE(nn.Module):
    """Router, routed experts (dropless), shared expert; `tokens_per_expert` and `expert_bias` buffers for the
    auxiliary-loss-free load balancing (`update_expert_bias`)."""

    def __init__(self, num_experts: int = EXPERTS, top_k: int = TOP_K):
        super().__init__()
        self.top_k = top_k
        self.router = TokenChoiceTopKRouter(num_experts, top_k)
        self.experts = GroupedExperts(num_experts)
        self.shared = nn.Sequential(nn.Linear(DIM, HIDDEN, bias=False), nn.SiLU(), nn.Linear(HIDDEN, DIM, bias=False))
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, DIM)
        top_scores, selected, counts = self.router(x, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        order = torch.argsort(selected.view(-1), stable=True)  # (token, choice) pairs grouped by expert
        scores_sorted = top_scores.view(-1)[order]
        routed_input = x[order // self.top_k] * scores_sorted[:, None].to(x.dtype)
        routed_output = self.experts(routed_input, counts)
        unsorted = routed_output.new_zeros(routed_output.shape)
        unsorted[order] = routed_output
        return (self.shared(x) + unsorted.view(-1, self.top_k, DIM).sum(1)).view(shape)


def update_expert_bias(model: nn.Module, dp_group: dist.ProcessGroup) -> list[list[int]]:
    """torchtitan's optimizer pre-step: each MoE layer's token counts summed over the dp ranks, its bias moved by
    `BIAS_RATE` towards the experts below the mean, the counts zeroed. Returns this rank's counts, per layer."""
    local = []
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MoE):
                counts = module.tokens_per_expert
                local.append([int(c) for c in counts.tolist()])
                dist.all_reduce(counts, group=dp_group)
                delta = BIAS_RATE * torch.sign(counts.mean() - counts)
                module.expert_bias.add_(delta - delta.mean())
                counts.zero_()
    return local


class Attention(nn.Module):
    """Causal self-attention, 2 heads, with torchtitan's projections (`wq`, `wk`, `wv`, `wo`): column- and row-wise
    under tensor parallelism, each rank then holding whole heads."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, DIM // 2).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, top_k: int = TOP_K):
        super().__init__()
        self.attn_norm, self.moe_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attn = Attention()
        self.moe = MoE(top_k=top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class DroplessMoETransformer(nn.Module):
    def __init__(self, n_layers: int = 2, top_k: int = TOP_K):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(top_k) for _ in range(n_layers))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def parallelize(
    system: str, model: DroplessMoETransformer, mesh: DeviceMesh, dp_mesh: DeviceMesh, exchange_counts: bool = True
) -> None:
    """torchtitan's order: expert parallelism on the experts, then FSDP: each block's experts over dp_shard_mod_ep
    (gradients divided by the whole dp size), each block over dp, the root last."""
    shard = fully_shard if system == "fsdp2" else fc.shard
    for block in model.layers:
        if "tp" in mesh.mesh_dim_names:
            parallelize_module(
                block.attn,
                mesh["tp"],
                {**dict.fromkeys(("wq", "wk", "wv"), ColwiseParallel()), "wo": RowwiseParallel()},
            )
        experts = block.moe.experts
        parallelize_module(experts, mesh["ep"], ExpertParallel(exchange_counts))
        shard(experts, mesh=mesh["dp_shard_mod_ep"])
        experts.set_gradient_divide_factor(dp_mesh.size())
        experts.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum: sum, then divide
        shard(block, mesh=dp_mesh)
    if system == "fsdp2":
        fully_shard(model, mesh=dp_mesh)
    else:
        fc.shard_compile(model, dp_mesh)


def train(
    system: str, mesh: DeviceMesh, dp_mesh: DeviceMesh, rank: int, steps: int, exchange_counts: bool = True
) -> dict:
    """`steps` AdamW steps of `system` on this rank's own batches: losses, token counts per step and layer, step
    times, every parameter in full, the experts' placements, and (ours) what was compiled."""
    clear_compiled_graphs()
    torch.manual_seed(0)
    model = DroplessMoETransformer()
    parallelize(system, model, mesh, dp_mesh, exchange_counts)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counts: list[list[list[int]]] = []
    opt.register_step_pre_hook(lambda *_: counts.append(update_expert_bias(model, dp_mesh.get_group())))
    gen = torch.Generator().manual_seed(100 + dp_mesh.get_local_rank())  # tensor-parallel peers: the same batch
    losses, times, after_first = [], [], None
    for step in range(steps):
        tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        if step == 0 and system == "ours":
            after_first = compile_counts()
    params = dict(model.named_parameters())
    w1, wq, wo = (
        params[f"layers.0.{name}.weight" if "." in name else f"layers.0.moe.experts.{name}"]
        for name in ("w1", "attn.wq", "attn.wo")
    )
    out = {
        "losses": losses,
        "counts": counts,
        "times": times,
        "params": {n: p.full_tensor() for n, p in params.items()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "experts": (w1.device_mesh.mesh_dim_names, tuple(str(p) for p in w1.placements)),
        "attention": tuple((p.device_mesh.mesh_dim_names, tuple(map(str, p.placements))) for p in (wq, wo)),
    }
    if system == "ours":
        out["graphs"] = [(r.kind, [(c.kind, bool(c.params)) for c in collectives(r.gm)]) for r in compiled_graphs()]
        out["compile_counts"] = (after_first, compile_counts())
    return out


def meshes(world_size: int, ep: int = 2, tp: int = 1) -> tuple[DeviceMesh, DeviceMesh]:
    """The (dp_shard_mod_ep, ep) mesh of the experts (with a last dim tp when `tp` > 1) and the dp mesh of the
    rest: all ranks, or the flattened (dp_shard_mod_ep, ep) dims beside tp."""
    if tp == 1:
        mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("dp_shard_mod_ep", "ep"))
        return mesh, init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    dims = ("dp_shard_mod_ep", "ep", "tp")
    mesh = init_device_mesh("cpu", (world_size // (ep * tp), ep, tp), mesh_dim_names=dims)
    return mesh, mesh["dp_shard_mod_ep", "ep"]._flatten("dp")


def dropless_training(
    rank: int, world_size: int, steps: int = STEPS, capture_scalars: bool = True, tp: int = 1
) -> dict:
    """Both systems on the same layout and batches; ours under `capture_scalar_outputs` (the `.tolist()` of the
    counts traced as unbacked sizes instead of breaking the graph), patched for these steps only. `tp` > 1: the
    attention tensor-parallel over a last mesh dim."""
    mesh, dp_mesh = meshes(world_size, tp=tp)
    out = {"fsdp2": train("fsdp2", mesh, dp_mesh, rank, steps)}
    with torch._dynamo.config.patch(capture_scalar_outputs=capture_scalars):
        out["ours"] = train("ours", mesh, dp_mesh, rank, steps)
    return out


def routing_differs_on_rank_1(rank: int, world_size: int) -> str | None:
    """Ours on 2 ranks (ep 2), where rank 1's routing skips the exchange of counts: the error each rank raises."""
    mesh, dp_mesh = meshes(world_size)
    try:
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            train("ours", mesh, dp_mesh, rank, 1, exchange_counts=rank != 1)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return str(e)
    return None


MODES = ("fsdp2", "graph-breaks", "unbacked")
"""benchmarks/dropless_moe.py's modes: `fully_shard`; ours under Dynamo's defaults; ours under
`capture_scalar_outputs`."""


def compile_modes(rank: int, world_size: int, steps: int) -> dict:
    """`train` in each of `MODES`, each compiling afresh, with Dynamo's graph breaks and the sizes the compiled
    graphs read from data (unbacked) added."""
    from torch._dynamo.utils import counters

    mesh, dp_mesh = meshes(world_size)
    out = {}
    for mode in MODES:
        torch._dynamo.reset()
        counters.clear()
        with torch._dynamo.config.patch(capture_scalar_outputs=mode == "unbacked"):
            r = train("fsdp2" if mode == "fsdp2" else "ours", mesh, dp_mesh, rank, steps)
        r["graph_breaks"] = sum(counters["graph_break"].values())
        scalar = torch.ops.aten._local_scalar_dense.default
        r["unbacked"] = sum(n.target is scalar for g in compiled_graphs() for n in g.gm.graph.nodes)
        out[mode] = r
    return out
