"""The planner: per-rank memory, bytes on the wire and simulated step time of a model sharded over N ranks,
without the memory or the ranks (the model on the meta device, one process, the fake process group).

Method:
- parameters, gradients, optimizer state: the REAL `shard` of the full model at world size N (rank 0, which holds
  the largest shard, ceil(dim0 / S) rows, S = N the shard size; HSDP with R replicas: S = N / R, mesh R x S);
  gradients are sharded like the parameters, in their dtype; AdamW keeps two fp32 states per element of the shard.
  Compared with the analytical numel x bytes / S.
- gathered working set: the root bucket (its parameters are used at both ends of the step) plus the two largest
  other buckets (the one in use and the one prefetched), full padded size in the parameter (communication) dtype.
- collectives, activations and time: the real pipeline compiles a reduced copy of the model (1 and 2 layers, same
  widths, when the factory takes `layers=`), runs its forward and backward on meta tensors, and the final graphs
  are simulated with each cost-model profile; per-layer figures (2 layers minus 1 layer) are scaled to the full
  layer count. Activations: the bytes the forward graph leaves alive for the backward (its non-input outputs).
  Bytes sent per rank: a ring over a collective's own group of G ranks sends (G-1)/G of an all-gather's or a
  reduce-scatter's full buffer and 2(G-1)/G of an all-reduce's (HSDP: G = R for the all-reduces).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from .cost_model import PROFILES, simulate
from .ir import CollectiveArgs, Role, nbytes
from .report import clear_compiled_graphs, collective, compiled_graphs, saved_bytes
from .shard import default_device_type

__all__ = [
    "Plan",
    "analytical_bytes",
    "block_list",
    "format_plan",
    "hsdp_mesh",
    "make_plan",
    "shard_blocks",
    "shard_for_plan",
    "sharded_bytes",
    "wire_bytes",
]

ADAMW_STATES = 2
"""AdamW keeps exp_avg and exp_avg_sq per parameter element (fp32 here)."""


@dataclass
class Plan:
    world_size: int
    params: int
    """Unique parameters of the full model (numel)."""
    layers: int
    per_rank_bytes: dict[str, int]
    analytical_bytes: dict[str, float]
    comm_bytes_per_step: int
    """Bytes one rank sends per step (ring algorithms over each collective's group of G ranks): (G-1)/G of every
    all-gather's and reduce-scatter's full buffer, 2(G-1)/G of every all-reduce's."""
    collective_buffer_bytes: dict[str, int]
    step_time_s: dict[str, float]
    exposed_comm_s: dict[str, float]
    method: str
    buckets: dict[str, int] = field(default_factory=dict)
    replicate: int = 1
    """HSDP: replicas (the mesh is replicate x shard_size); 1 = plain FSDP over all ranks."""

    @property
    def shard_size(self) -> int:
        """Ranks each parameter is sharded over: world_size / replicate."""
        return self.world_size // self.replicate

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "replicate": self.replicate,
            "shard_size": self.shard_size,
            "params": self.params,
            "layers": self.layers,
            "per_rank_bytes": self.per_rank_bytes,
            "analytical_bytes": self.analytical_bytes,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "collective_buffer_bytes": self.collective_buffer_bytes,
            "step_time_s": self.step_time_s,
            "exposed_comm_s": self.exposed_comm_s,
            "profiles": {n: {"alpha_s": p.alpha_s, "beta_s_per_byte": p.beta_s_per_byte, "flops_per_s": p.flops_per_s,
                             "mem_bytes_per_s": p.mem_bytes_per_s, "source": p.source}
                         for n, p in PROFILES.items() if n in self.step_time_s},
            "method": self.method,
        }


def hsdp_mesh(world_size: int, replicate: int):
    """The 2-D mesh `(replicate, world_size // replicate)` with dims ("replicate", "shard") over the default process
    group; None for `replicate == 1` (shard() then uses its 1-D default mesh). Same device rule as that default."""
    if replicate == 1:
        return None
    if replicate < 1 or world_size % replicate:
        raise ValueError(f"world size {world_size} is not a multiple of {replicate} replicas")
    return init_device_mesh(default_device_type(), (replicate, world_size // replicate), mesh_dim_names=("replicate", "shard"))


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList | None]:
    """The longest `nn.ModuleList` of the model (its repeated blocks) and its path."""
    best = ("", None)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and (best[1] is None or len(module) > len(best[1])):
            best = (name, module)
    return best


def shard_blocks(model: nn.Module, mesh=None, **shard_kwargs) -> None:
    """`shard` each block of the model's longest ModuleList (FSDP2's pattern, before the root; the CLI's and the
    planner's convention)."""
    from .shard import shard

    _, blocks = block_list(model)
    for block in blocks if blocks is not None else ():
        shard(block, mesh, **shard_kwargs)


def shard_for_plan(model: nn.Module, blocks: bool = True, **shard_kwargs) -> nn.Module:
    """FSDP2's pattern: `shard` each block of the longest ModuleList (unless `blocks` is False), then the root."""
    from .shard import shard

    if blocks:
        shard_blocks(model, **shard_kwargs)
    return shard(model, **shard_kwargs)


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    seen, params = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def analytical_bytes(model: nn.Module, world_size: int) -> dict[str, float]:
    """numel x bytes / N for parameters and gradients, 2 x 4 bytes x numel / N for AdamW (unsharded model); N is
    the number of ranks a parameter is sharded over (HSDP: the shard size)."""
    params = sum(nbytes(p) for p in _unique_params(model))
    grads = sum(nbytes(p) for p in _unique_params(model) if p.requires_grad)
    optim = sum(ADAMW_STATES * 4 * p.numel() for p in _unique_params(model) if p.requires_grad)
    return {"params": params / world_size, "grads": grads / world_size, "optimizer": optim / world_size}


def sharded_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and AdamW state, counted on the sharded model's local tensors."""
    local = [(p, p.to_local() if isinstance(p, DTensor) else p) for p in _unique_params(model)]
    return {
        "params": sum(nbytes(t) for _, t in local),
        "grads": sum(nbytes(t) for p, t in local if p.requires_grad),
        "optimizer": sum(ADAMW_STATES * 4 * t.numel() for p, t in local if p.requires_grad),
    }


def _bucket_bytes(model: nn.Module, param_dtype: torch.dtype | None) -> dict[str, int]:
    """Full padded bytes each bucket (`shard` call) gathers."""
    from .ops import padded_rows
    from .shard import managed_params

    buckets: dict[str, int] = {}
    for _, p, info in managed_params(model):
        rows = padded_rows(p.shape[0], info.world_size) * info.world_size
        itemsize = torch.empty((), dtype=param_dtype or p.dtype).element_size()
        buckets[info.bucket] = buckets.get(info.bucket, 0) + rows * math.prod(p.shape[1:]) * itemsize
    return buckets


@dataclass
class _GraphFigures:
    comm_wire: float
    buffers: dict[str, int]
    activations: int
    time: dict[str, float]
    exposed: dict[str, float]


def wire_bytes(gm) -> tuple[float, dict[str, int]]:
    """(bytes one rank sends, full buffer bytes by collective kind) of a graph's collectives: a ring over the
    collective's own group of G ranks sends (G-1)/G of the buffer, twice that for an all-reduce."""
    from ._torch_private import group_size

    buffers: dict[str, int] = {}
    wire = 0.0
    for node in gm.graph.nodes:
        c = collective(node)
        if c is None:
            continue
        group = group_size(CollectiveArgs.of(node).group_name)
        buffers[c.kind] = buffers.get(c.kind, 0) + c.nbytes
        wire += (group - 1) / group * c.nbytes * (2 if c.kind == Role.ALL_REDUCE else 1)
    return wire, buffers


def _compile_and_measure(model, args, loss_fn, mesh, compile_kwargs, profiles) -> _GraphFigures:
    from .api import shard_compile

    shard_blocks(model, mesh, reshard_after_forward=compile_kwargs["reshard_after_forward"],
                 mp_policy=compile_kwargs["mp_policy"])
    clear_compiled_graphs()
    shard_compile(model, mesh, **compile_kwargs)
    loss_fn(model(*args)).backward()
    records = [r for r in compiled_graphs() if r.kind in ("forward", "backward")]
    buffers: dict[str, int] = {}
    wire = 0.0
    for r in records:
        graph_wire, graph_buffers = wire_bytes(r.gm)
        wire += graph_wire
        for kind, nbytes in graph_buffers.items():
            buffers[kind] = buffers.get(kind, 0) + nbytes
    forward = [r for r in records if r.kind == "forward"]
    timelines = {name: [simulate(r.gm, PROFILES[name]) for r in records] for name in profiles}
    clear_compiled_graphs()
    return _GraphFigures(
        comm_wire=wire,
        buffers=buffers,
        activations=sum(saved_bytes(r.gm) for r in forward),
        time={n: sum(t.total_s for t in tls) for n, tls in timelines.items()},
        exposed={n: sum(t.exposed_comm_s for t in tls) for n, tls in timelines.items()},
    )


def _scale(one: float, two: float, layers: int) -> float:
    """Linear in the layer count through the 1- and 2-layer figures."""
    return two + (layers - 2) * (two - one)


def make_plan(
    factory: Callable,
    world_size: int,
    *,
    replicate: int = 1,
    call: Callable = lambda f, **kw: f(**kw),
    profiles: list[str] | None = None,
    mp_policy=None,
    reshard_after_forward: bool = True,
    progress: Callable[[str], object] | None = None,
) -> Plan:
    """Plan `factory`'s model at `world_size` ranks; `replicate` > 1: HSDP on a `replicate x world_size/replicate`
    mesh (`hsdp_mesh`). Needs the default process group of `world_size` ranks (the fake one);
    `call(factory, **kwargs)` builds `(model, args, loss_fn)` (the CLI's checked call)."""
    from .config import CompileConfig, MixedPrecisionPolicy

    mp_policy = mp_policy or MixedPrecisionPolicy()
    profiles = profiles or list(PROFILES)
    step = progress or (lambda msg: None)
    mesh = hsdp_mesh(world_size, replicate)
    shard_size = world_size // replicate

    step("building the full model")
    model, _, _ = call(factory)
    path, blocks = block_list(model)
    layers = len(blocks) if blocks is not None else 0
    analytical = analytical_bytes(model, shard_size)
    n_params = sum(p.numel() for p in _unique_params(model))
    where = f"{world_size} ranks" if mesh is None else f"a {replicate} x {shard_size} mesh (replicate x shard)"
    step(f"sharding the full model over {where}")
    shard_for_plan(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    measured = sharded_bytes(model)
    buckets = _bucket_bytes(model, mp_policy.param_dtype)
    root = buckets.get("", 0)
    others = sorted((b for name, b in buckets.items() if name), reverse=True)
    gathered_peak = root + sum(others[:2])
    del model

    compile_kwargs = {
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy,
        "compile_config": CompileConfig(hardware=profiles[0], check_rank_consistency=False),
    }
    takes_layers = "layers" in inspect.signature(factory).parameters
    if takes_layers and layers > 2:
        figures = []
        for n in (1, 2):
            step(f"compiling a {n}-layer copy (same widths) through the pipeline")
            figures.append(_compile_and_measure(*call(factory, layers=n), mesh, compile_kwargs, profiles))
        one, two = figures
        comm = _scale(one.comm_wire, two.comm_wire, layers)
        buffers = {k: int(_scale(one.buffers.get(k, 0), two.buffers[k], layers)) for k in two.buffers}
        activations = _scale(one.activations, two.activations, layers)
        time = {n: _scale(one.time[n], two.time[n], layers) for n in profiles}
        exposed = {n: _scale(one.exposed[n], two.exposed[n], layers) for n in profiles}
        method = (f"full model ({n_params:,} params, {layers} blocks in '{path}') sharded with shard() for the "
                  "per-rank parameter / gradient / optimizer bytes; collectives, activations and time from the "
                  f"pipeline's graphs of 1- and 2-block copies, scaled linearly to {layers} blocks")
    else:
        step("compiling the model through the pipeline")
        f = _compile_and_measure(*call(factory), mesh, compile_kwargs, profiles)
        comm, buffers, activations, time, exposed = f.comm_wire, f.buffers, f.activations, f.time, f.exposed
        method = (f"full model ({n_params:,} params) sharded with shard() for the per-rank bytes; collectives, "
                  "activations and time from the pipeline's graphs of the full model")
    per_rank = {
        "params": measured["params"],
        "grads": measured["grads"],
        "optimizer": measured["optimizer"],
        "gathered_peak": int(gathered_peak),
        "activations": int(activations),
    }
    per_rank["total"] = sum(per_rank.values())
    if mesh is not None:
        method += (f"; HSDP: parameters sharded over {shard_size} ranks, replicated {replicate} times, gradients "
                   f"reduce-scattered over {shard_size} ranks then all-reduced over {replicate}")
    return Plan(world_size, n_params, layers, per_rank, analytical, int(comm), buffers, time, exposed, method, buckets,
                replicate)


def _gib(n: float) -> str:
    return f"{n / 2**30:10.3f} GiB"


def format_plan(plan, seconds: float, rss: int) -> str:
    pr, an = plan.per_rank_bytes, plan.analytical_bytes
    header = f"plan: {plan.params:,} parameters, {plan.layers} blocks, world size {plan.world_size}"
    if plan.replicate > 1:
        header += f", mesh {plan.replicate} x {plan.shard_size} (replicate x shard)"
    divisor = "N" if plan.replicate == 1 else "(N/R)"
    out = [header, "", "per-rank memory (rank 0, the largest shard)"]
    for key in ("params", "grads", "optimizer"):
        error = (pr[key] - an[key]) / an[key] * 100 if an[key] else 0.0
        out.append(f"  {key:<14}{_gib(pr[key])}   analytical numel*bytes/{divisor} {_gib(an[key])}  ({error:+.3f}%)")
    out.append(f"  {'gathered_peak':<14}{_gib(pr['gathered_peak'])}   root bucket + 2 largest block buckets")
    out.append(f"  {'activations':<14}{_gib(pr['activations'])}   saved by forward for backward")
    out.append(f"  {'total':<14}{_gib(pr['total'])}")
    out.append("")
    buffers = ", ".join(f"{k} {_gib(v).strip()}" for k, v in sorted(plan.collective_buffer_bytes.items()))
    ring = "(N-1)/N of the buffers" if plan.replicate == 1 else (
        f"(G-1)/G of each buffer, 2(G-1)/G of an all-reduce's; G = its group, "
        f"{plan.shard_size} or {plan.replicate} ranks")
    out.append(f"communication per step: {_gib(plan.comm_bytes_per_step).strip()} sent per rank ({ring}: {buffers})")
    out.append("")
    out.append(f"  {'profile':<20}{'step time':>12}{'exposed comm':>14}   alpha, link, FLOP/s, memory; source")
    for name, t in plan.step_time_s.items():
        p = PROFILES[name]
        out.append(
            f"  {name:<20}{t * 1e3:>9.1f} ms{plan.exposed_comm_s[name] * 1e3:>11.1f} ms   "
            f"{p.alpha_s * 1e6:.0f} us, {1 / p.beta_s_per_byte / 1e9:.3g} GB/s, {p.flops_per_s / 1e12:.3g} TFLOP/s, "
            f"{p.mem_bytes_per_s / 1e9:.3g} GB/s; {p.source}"
        )
    out.append("")
    out.append(f"method: {plan.method}")
    out.append(f"planner: {seconds:.1f} s wall, peak RSS {rss / 2**20:.0f} MiB")
    return "\n".join(out) + "\n"
