"""The planner: per-rank memory, bytes on the wire, step time, tokens/s and MFU of a model sharded over N ranks,
without the memory or the ranks (the model on the meta device, one process, the fake process group).

Method:
- parameters, gradients, optimizer state: the REAL `shard` of the full model at world size N (rank 0, which holds
  the largest shard, ceil(dim0 / S) rows, S = N the shard size; HSDP with R replicas: S = N / R, mesh R x S);
  gradients are sharded like the parameters, in their dtype; AdamW keeps two fp32 states per element of the shard.
  Compared with the analytical numel x bytes / S.
- reduced copies (`reduced_depth.py`): the factory's `layers=` 1 and 2, or else the model's block list cut to 1 and 2
  blocks; per-block figures (2 blocks minus 1) are scaled to the full block count.
- collectives: the real pipeline compiles each copy and the final graphs' collectives give the bytes sent. A ring
  over a collective's group of G ranks sends (G-1)/G of an all-gather's or reduce-scatter's full buffer and
  2(G-1)/G of an all-reduce's (HSDP: G = R for the all-reduces). Timed on the profile's link, a reduce-scatter
  times the device's `reduce_scatter_factor` (gloo's takes as long as an all-reduce: 2, measured) unless its group
  has two ranks (the pipeline then runs it as an all-to-all: 1).
- activations and compute: one step of each copy played op by op on the meta device (`trace.py`), with the
  attention (`attention.py`) and activation checkpointing (`activation_checkpointing.py`) asked for; time, schedule and the
  allocator's peak from `step_model.py`, device figures from `devices.py`.
- tensor parallelism (`tp` > 1, `tensor_parallel.py`): the mesh is (dp, tp) (or (replicate, shard, tp)), the TP plan is
  applied to every block with `parallelize_module` before `shard` over dp, so the per-rank bytes are the real
  (dp, tp)-local shards; TP's collectives (Role.TP in the compiled graphs) are counted apart from FSDP's, per layer
  (2 blocks minus 1), and timed on the profile's intra-node link, on the critical path (nothing overlaps them);
  compute and activations are traced on a TP-local copy (column-wise Linears with out / tp features, row-wise with
  in / tp); MFU counts the unsplit model's FLOPs / tp per rank, tokens/s per rank the dp rank's tokens / tp
  (torchtitan's per-GPU figures).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2_compile.compiler.report import clear_compiled_graphs, collective, compiled_graphs, is_tp
from fsdp2_compile.config import CompileConfig, MixedPrecisionPolicy
from fsdp2_compile.core.hardware import PROFILES
from fsdp2_compile.core.ir import BUCKET, CollectiveArgs, Role, nbytes
from fsdp2_compile.debug.sizes import size_text
from fsdp2_compile.planner.activation_checkpointing import has_checkpointing, unwrap_checkpointing
from fsdp2_compile.planner.devices import device_for
from fsdp2_compile.planner.reduced_depth import block_list, reduced_copy, scale
from fsdp2_compile.planner.step_model import StepComm, forward_backward_time, memory_peak, optimizer_time, phase_times
from fsdp2_compile.planner.tensor_parallel import (
    apply_tp,
    plan_meshes,
    plan_text,
    tp_collective_s,
    tp_local_copy,
    tp_plan_for,
)
from fsdp2_compile.planner.trace import StepTrace, trace_step

__all__ = [
    "Layout",
    "Plan",
    "analytical_bytes",
    "block_list",
    "format_plan",
    "make_plan",
    "shard_blocks",
    "shard_for_plan",
    "tokens_of",
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
    tokens_per_s_per_rank: dict[str, float] = field(default_factory=dict)
    mfu: dict[str, float] = field(default_factory=dict)
    """Model FLOPs (3 x the forward's, recomputation not counted) / step time / the device's peak FLOP/s."""
    peak_reserved_bytes: dict[str, int] = field(default_factory=dict)
    """Per profile: the allocated peak x the allocator factor + the runtime's memory (what the device reports)."""
    compute_s: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per profile: forward, backward (recomputation included) and optimizer seconds."""
    assumptions: dict[str, object] = field(default_factory=dict)
    tp: int = 1
    """Tensor-parallel degree: the mesh is (replicate x) shard x tp; 1 = no tensor parallelism."""
    tp_plan: str = ""
    """Which TP plan was applied (the factory's or the default), per block; "" without TP."""
    tp_comm_bytes_per_step: int = 0
    """Bytes one rank sends per step in TP's collectives (ring over the tp group), not in comm_bytes_per_step."""
    tp_collective_buffer_bytes: dict[str, int] = field(default_factory=dict)
    """TP's full buffers per step by collective kind (FSDP's are collective_buffer_bytes)."""
    tp_collectives_per_layer: dict[str, dict[str, int]] = field(default_factory=dict)
    """TP's collectives in one block, by graph ("forward", "backward") and kind."""
    tp_collectives_per_step: dict[str, dict[str, int]] = field(default_factory=dict)
    """TP's collectives of the whole step, by graph and kind."""
    tp_comm_s: dict[str, float] = field(default_factory=dict)
    """Per profile: seconds of TP's collectives per step on the intra-node link (in step_time_s and
    exposed_comm_s: they sit on the critical path)."""
    kept_gathered: dict[str, object] = field(default_factory=dict)
    """Selective unsharding (`keep_gathered`): the kept buckets, their gathered bytes per rank, the budget, the
    resharded buckets' bytes and the bytes one rank sends less per step; {} without it."""

    @property
    def shard_size(self) -> int:
        """Ranks each parameter is sharded over by FSDP: world_size / (replicate x tp)."""
        return self.world_size // (self.replicate * self.tp)

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
            "tokens_per_s_per_rank": self.tokens_per_s_per_rank,
            "mfu": self.mfu,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "compute_s": self.compute_s,
            "assumptions": self.assumptions,
            "tp": self.tp,
            "tp_plan": self.tp_plan,
            "tp_comm_bytes_per_step": self.tp_comm_bytes_per_step,
            "tp_collective_buffer_bytes": self.tp_collective_buffer_bytes,
            "tp_collectives_per_layer": self.tp_collectives_per_layer,
            "tp_collectives_per_step": self.tp_collectives_per_step,
            "tp_comm_s": self.tp_comm_s,
            "kept_gathered": self.kept_gathered,
            "profiles": {
                n: {
                    "alpha_s": p.alpha_s,
                    "beta_s_per_byte": p.beta_s_per_byte,
                    "flops_per_s": p.flops_per_s,
                    "mem_bytes_per_s": p.mem_bytes_per_s,
                    "source": p.source,
                    "device": {
                        **{k: v for k, v in device_for(n).__dict__.items() if k != "sources"},
                        "sources": device_for(n).sources,
                    },
                }
                for n, p in PROFILES.items()
                if n in self.step_time_s
            },
            "method": self.method,
        }


def shard_blocks(model: nn.Module, mesh=None, **shard_kwargs) -> None:
    """`shard` each block of the model's longest ModuleList (FSDP2's pattern, before the root; the CLI's and the
    planner's convention)."""
    from fsdp2_compile.runtime.sharding import shard

    _, blocks = block_list(model)
    for block in blocks if blocks is not None else ():
        shard(block, mesh, **shard_kwargs)


def shard_for_plan(model: nn.Module, blocks: bool = True, **shard_kwargs) -> nn.Module:
    """FSDP2's pattern: `shard` each block of the longest ModuleList (unless `blocks` is False), then the root."""
    from fsdp2_compile.runtime.sharding import shard

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


def analytical_bytes(model: nn.Module, world_size: int, tp: int = 1) -> dict[str, float]:
    """numel x bytes / N for parameters and gradients, 2 x 4 bytes x numel / N for AdamW (unsharded model); N is
    the number of ranks a parameter is sharded over (HSDP: the shard size), times `tp` for a parameter tensor
    parallelism shards (a DTensor with a Shard placement, after the TP plan)."""

    def ranks(p) -> int:
        return world_size * tp if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements) else world_size

    params = sum(nbytes(p) / ranks(p) for p in _unique_params(model))
    grads = sum(nbytes(p) / ranks(p) for p in _unique_params(model) if p.requires_grad)
    optim = sum(ADAMW_STATES * 4 * p.numel() / ranks(p) for p in _unique_params(model) if p.requires_grad)
    return {"params": params, "grads": grads, "optimizer": optim}


def sharded_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and AdamW state, counted on the sharded model's local tensors."""
    local = [(p, p.to_local() if isinstance(p, DTensor) else p) for p in _unique_params(model)]
    return {
        "params": sum(nbytes(t) for _, t in local),
        "grads": sum(nbytes(t) for p, t in local if p.requires_grad),
        "optimizer": sum(ADAMW_STATES * 4 * t.numel() for p, t in local if p.requires_grad),
    }


def _resharded_sizes(model: nn.Module, itemsize: int) -> dict[str, int]:
    """Gathered bytes of each bucket resharded after forward (unpadded, as selective unsharding counts them), in
    the order of last use in forward: the blocks in order, then the root (whose head comes last)."""
    from fsdp2_compile.runtime.sharding import managed_params

    sizes: dict[str, int] = {}
    for _, p, info in managed_params(model):
        if info.reshard_after_forward:
            sizes[info.bucket] = sizes.get(info.bucket, 0) + math.prod(p.shape) * itemsize
    return {b: sizes[b] for b in sorted(sizes, key=lambda b: b == "")}


def _bucket_numel(model: nn.Module) -> dict[str, int]:
    """Full padded elements each bucket (`shard` call) gathers, in bucket order (blocks, then the root)."""
    from fsdp2_compile.core.ops import padded_rows
    from fsdp2_compile.runtime.sharding import managed_params

    buckets: dict[str, int] = {}
    for _, p, info in managed_params(model):
        rows = padded_rows(info.dim0, info.world_size) * info.world_size
        local = p.to_local() if isinstance(p, DTensor) else p  # trailing dims: TP-local under tensor parallelism
        buckets[info.bucket] = buckets.get(info.bucket, 0) + rows * math.prod(local.shape[1:])
    return buckets


@dataclass
class _GraphFigures:
    comm_wire: float
    buffers: dict[str, int]
    tp_wire: float = 0.0
    tp_buffers: dict[str, int] = field(default_factory=dict)
    tp_collectives: list[tuple[str, str, int, int]] = field(default_factory=list)
    """TP's collectives: (graph kind, collective kind, full buffer bytes, group size)."""
    backward_gathers: dict[str, int] = field(default_factory=dict)
    """Full buffer bytes backward all-gathers again, by bucket."""

    def tp_counts(self, graph: str, kind: str) -> int:
        return sum(1 for g, k, _, _ in self.tp_collectives if g == graph and k == kind)


def _compile_and_measure(model, args, loss_fn, mesh, compile_kwargs, tp_mesh=None, tp_plan=None) -> _GraphFigures:
    """Bytes on the wire and collective buffers of the pipeline's final forward and backward graphs (FSDP's; TP's
    apart when `tp_mesh` is given and `tp_plan` is applied to the blocks first)."""
    from fsdp2_compile._torch_private import group_size
    from fsdp2_compile.api import make_backend

    unwrap_checkpointing(model)  # checkpointing changes no collective
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, tp_plan)
    shard_for_plan(
        model,
        mesh=mesh,
        reshard_after_forward=compile_kwargs["reshard_after_forward"],
        mp_policy=compile_kwargs["mp_policy"],
    )
    clear_compiled_graphs()
    torch.compiler.reset()  # the copies are throwaway; without it a process that plans often hits recompile_limit
    # torch.compile on the sharded meta model directly: shard_compile's call wrapper refuses meta parameters
    # (a user's forward must not run on them), and the planner only needs the graphs
    compiled = torch.compile(model, backend=make_backend(compile_kwargs["compile_config"]))
    loss_fn(compiled(*args)).backward()
    records = [r for r in compiled_graphs() if r.kind in ("forward", "backward")]
    figures = _GraphFigures(0.0, {})
    for r in records:
        for tp, buffers in ((False, figures.buffers), (True, figures.tp_buffers)):
            graph_wire, graph_buffers = wire_bytes(r.gm, tp=tp)
            if tp:
                figures.tp_wire += graph_wire
            else:
                figures.comm_wire += graph_wire
            for kind, size in graph_buffers.items():
                buffers[kind] = buffers.get(kind, 0) + size
        for node in r.gm.graph.nodes:
            c = collective(node)
            if c is not None and is_tp(node):
                figures.tp_collectives.append(
                    (r.kind, str(c.kind), c.nbytes, group_size(CollectiveArgs.of(node).group_name))
                )
            elif c is not None and r.kind == "backward" and c.kind == Role.ALL_GATHER:
                bucket = node.meta.get(BUCKET, "")
                figures.backward_gathers[bucket] = figures.backward_gathers.get(bucket, 0) + c.nbytes
    clear_compiled_graphs()
    return figures


def wire_bytes(gm, tp: bool | None = None) -> tuple[float, dict[str, int]]:
    """(bytes one rank sends, full buffer bytes by collective kind) of a graph's collectives: a ring over the
    collective's own group of G ranks sends (G-1)/G of the buffer, twice that for an all-reduce. `tp`: None every
    collective, False FSDP's only, True tensor parallelism's only."""
    from fsdp2_compile._torch_private import group_size

    buffers: dict[str, int] = {}
    wire = 0.0
    for node in gm.graph.nodes:
        c = collective(node)
        if c is None or (tp is not None and is_tp(node) != tp):
            continue
        group = group_size(CollectiveArgs.of(node).group_name)
        buffers[c.kind] = buffers.get(c.kind, 0) + c.nbytes
        wire += (group - 1) / group * c.nbytes * (2 if c.kind == Role.ALL_REDUCE else 1)
    return wire, buffers


def tokens_of(args: tuple) -> int:
    """Tokens one rank processes per step: the elements of the first integer tensor input (token ids), else the
    rows of the first tensor input (all dims but the last)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for t in tensors:
        if not t.is_floating_point():
            return t.numel()
    return math.prod(tensors[0].shape[:-1]) if tensors else 1


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_FUSED = {"aot_eager": False, "inductor": True, "inductor-blocks": "blocks"}
"""The kernels a plan assumes, and what the traced step fuses under each (`StepTrace.materialized`)."""


def _is_count(value: object) -> bool:
    """A whole number >= 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Layout:
    """What a plan is made for: the ranks, their mesh and the knobs of the training step. Frozen and compared by
    value (hashable): layouts can be enumerated, compared and used as keys. Checked when built."""

    world_size: int
    """Ranks in all (N); `make_plan` needs the default process group of that many ranks (the fake one)."""
    replicate: int = 1
    """HSDP replicas (R): the mesh is R x N/R (replicate x shard); 1 = plain FSDP over all ranks."""
    tp: int = 1
    """Tensor-parallel degree (T) inside FSDP (`tensor_parallel.py`): the mesh is N/T x T (dp x tp), or R x N/(R T) x T;
    the factory's `tp_plan` or the default one is applied to every block; 1 = no tensor parallelism."""
    reshard_after_forward: bool | None = None
    """As `shard`'s: None FSDP2's default (the blocks reshard, the root keeps its parameters), True or False."""
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()
    """Mixed precision as `shard`'s; MixedPrecisionPolicy() computes and reduces in the parameters' dtype."""
    attention: str = "fused"
    """The attention kernel the trace assumes: "fused" (flash / memory-efficient) or "math"."""
    ac: str = "none"
    """Activation checkpointing of the blocks: "none", "full" or "selective" (torchtitan's op policy); a model the
    factory already checkpointed is planned as given."""
    compiler: str = "aot_eager"
    """Kernels: "aot_eager" (eager), "inductor" (fused elementwise) or "inductor-blocks" (Inductor on each block
    only, the rest eager: torchtitan's per-block compile)."""
    prefetch: int = CompileConfig.prefetch_depth
    """Blocks gathered ahead of the one in use (`CompileConfig.prefetch_depth`)."""
    keep_gathered: int | float | None = None
    """Selective unsharding as `CompileConfig.keep_gathered`, decided on the full model's buckets (blocks in order,
    then the root) by the compiler's own rule (`selective_unshard.choose_kept`): the kept buckets' backward
    all-gathers leave the bytes and the schedule, their gathered parameters stay in memory from forward to backward
    (counted in activations and the peak)."""
    memory_budget_bytes: int | None = None
    """As `CompileConfig.memory_budget_bytes`: what it leaves beyond the prefetch window is kept the same way
    (`selective_unshard.keep_amount`)."""

    def __post_init__(self) -> None:
        for name, what in (
            ("world_size", "a number of ranks"),
            ("replicate", "a number of replicas (1: no HSDP)"),
            ("tp", "a tensor-parallel degree (1: no TP)"),
        ):
            if not _is_count(getattr(self, name)):
                raise ValueError(f"Layout.{name}={getattr(self, name)!r}: use {what}, a whole number >= 1")
        if self.world_size % (self.replicate * self.tp):
            raise ValueError(
                f"Layout.world_size={self.world_size} is not a multiple of replicate {self.replicate} x tp "
                f"{self.tp}: the mesh is replicate x shard x tp; pass a world_size that is a multiple of "
                f"{self.replicate * self.tp}, or a replicate and tp whose product divides {self.world_size}"
            )
        if self.reshard_after_forward not in (None, True, False):
            raise ValueError(
                f"Layout.reshard_after_forward={self.reshard_after_forward!r}: use None (FSDP2's "
                "default), True or False (resharding to a smaller group is not planned)"
            )
        if not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise ValueError(
                f"Layout.mp_policy={self.mp_policy!r}: use a MixedPrecisionPolicy "
                "(MixedPrecisionPolicy() for the parameters' own dtype)"
            )
        for name, choices in (
            ("attention", ("fused", "math")),
            ("ac", ("none", "full", "selective")),
            ("compiler", tuple(_FUSED)),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"Layout.{name}={getattr(self, name)!r} is not one of: {', '.join(choices)}")
        # the compiler's own checks, so that the plan refuses what the compiler refuses
        for name, option in (
            ("prefetch", "prefetch_depth"),
            ("keep_gathered", "keep_gathered"),
            ("memory_budget_bytes", "memory_budget_bytes"),
        ):
            try:
                CompileConfig(**{option: getattr(self, name)})
            except ValueError as e:
                raise ValueError(f"Layout.{name}: {e}") from None

    @property
    def shard_size(self) -> int:
        """Ranks each parameter is sharded over by FSDP: world_size / (replicate x tp)."""
        return self.world_size // (self.replicate * self.tp)


@dataclass
class _FullModel:
    """What the plan takes from the full model sharded at the layout (rank 0, the largest shard)."""

    params: int
    """Unique parameters (numel)."""
    tokens: int
    """Tokens one rank processes per step."""
    block_path: str
    has_blocks: bool
    layers: int
    given_ac: bool
    """The factory's model is already checkpointed."""
    tp_plan: dict | None
    tp_text: str
    analytical: dict[str, float]
    measured: dict[str, int]
    numel: dict[str, int]
    """Full padded elements each bucket gathers (blocks, then the root "")."""
    buckets: dict[str, int]
    """Gathered bytes of each bucket, in the parameters' compute dtype."""
    resharded: dict[str, int]
    """Gathered bytes of the buckets resharded after forward, in their order of last use in forward."""
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype


@dataclass
class _Copies:
    """The compiled graphs' figures and the traced steps of the 1- and 2-block copies (or of the whole model when
    it has no more than 2 blocks), and how to take the full model's figures from them."""

    layers: int
    reduce: bool
    """Figures come from the 1- and 2-block copies."""
    figures: list[_GraphFigures]
    traces: list[StepTrace]
    full_traces: list[StepTrace]
    """Under TP: the unsplit copies' traces (for the model's FLOPs); else empty."""
    hows: list[str]
    tp_left: list[str]
    """Under TP: the modules the TP-local copy left whole."""

    def extrapolate(self, values: list[float]) -> float:
        """The full model's figure from the copies' (linear in the block count)."""
        return scale(values[0], values[1], self.layers) if self.reduce else values[0]

    def split(self, values: list[float]) -> tuple[float, float]:
        """(one block's share, the rest outside the blocks) of the copies' figures; (0, the figure) unreduced."""
        if not self.reduce:
            return 0.0, values[0]
        block = values[1] - values[0]
        return block, values[0] - block

    @property
    def reduction(self) -> str:
        return (
            f"1- and 2-block copies ({self.hows[0]}; {self.hows[1]}), scaled linearly to {self.layers} blocks"
            if self.reduce
            else "the full model"
        )


@dataclass
class _Communication:
    """Bytes one rank sends per step and the collectives' full buffers, FSDP's and TP's apart."""

    wire: float
    buffers: dict[str, int]
    tp_wire: float
    tp_buffers: dict[str, int]
    tp_per_layer: dict[str, dict[str, int]]
    tp_per_step: dict[str, dict[str, int]]


@dataclass
class _ProfileFigures:
    """A plan's figures on one device profile."""

    step_s: float
    exposed_s: float
    tokens_per_s: float
    mfu: float
    reserved: int
    compute: dict[str, float]
    tp_s: float


def _shard_full_model(factory: Callable, layout: Layout, call: Callable, meshes: tuple, step: Callable) -> _FullModel:
    """Build the full model, apply the TP plan, shard it at the layout and take its per-rank bytes and buckets."""
    mesh, tp_mesh = meshes
    step("building the full model")
    model, full_args, _ = call(factory)
    path, blocks = block_list(model)
    given_ac = has_checkpointing(model)
    n_params = sum(p.numel() for p in _unique_params(model))
    tp_plan, tp_text = None, ""
    if tp_mesh is not None:
        unwrap_checkpointing(model)  # the plan names block-relative modules; checkpointing changes no shard
        if blocks is None:
            raise ValueError("--tp needs a model with an nn.ModuleList of blocks to apply the TP plan to")
        tp_plan, source = tp_plan_for(factory, blocks[0])
        tp_text = plan_text(tp_plan, source)
        step(f"applying {tp_text} on the tp mesh of {layout.tp} ranks")
        apply_tp(model, tp_mesh, tp_plan)
    analytical = analytical_bytes(model, layout.shard_size, layout.tp)
    mp_policy = layout.mp_policy
    param_dtype = mp_policy.param_dtype or next(
        (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32
    )
    replicate, shard_size = layout.replicate, layout.shard_size
    where = f"{layout.world_size} ranks" if mesh is None else f"a {replicate} x {shard_size} mesh (replicate x shard)"
    if tp_mesh is not None:
        where = f"dp ({shard_size} ranks" + (f" x {replicate} replicas" if replicate > 1 else "") + f"), tp {layout.tp}"
    step(f"sharding the full model over {where}")
    shard_for_plan(model, mesh=mesh, reshard_after_forward=layout.reshard_after_forward, mp_policy=mp_policy)
    numel = _bucket_numel(model)
    return _FullModel(
        params=n_params,
        tokens=tokens_of(full_args),
        block_path=path,
        has_blocks=blocks is not None,
        layers=len(blocks) if blocks is not None else 0,
        given_ac=given_ac,
        tp_plan=tp_plan,
        tp_text=tp_text,
        analytical=analytical,
        measured=sharded_bytes(model),
        numel=numel,
        buckets={b: n * _itemsize(param_dtype) for b, n in numel.items()},
        resharded=_resharded_sizes(model, _itemsize(param_dtype)),
        param_dtype=param_dtype,
        reduce_dtype=mp_policy.reduce_dtype or param_dtype,
    )


def _kept_decision(layout: Layout, full: _FullModel):
    """Selective unsharding's decision on the full model's buckets (`KeptGathered`), None without it."""
    from fsdp2_compile.compiler.selective_unshard import choose_kept, keep_amount

    config = CompileConfig(
        keep_gathered=layout.keep_gathered,
        memory_budget_bytes=layout.memory_budget_bytes,
        prefetch_depth=layout.prefetch,
    )
    keep = keep_amount(config, max(full.buckets.values(), default=0))
    return None if keep is None else choose_kept(full.resharded, keep)


def _compile_and_trace_copies(
    factory: Callable,
    layout: Layout,
    call: Callable,
    meshes: tuple,
    full: _FullModel,
    ac_used: str,
    hardware: str,
    step: Callable,
) -> _Copies:
    """Compile each copy through the pipeline (its collectives) and play one step of it on meta (its ops)."""
    mesh, tp_mesh = meshes
    compile_kwargs = {
        "reshard_after_forward": layout.reshard_after_forward,
        "mp_policy": layout.mp_policy,
        "compile_config": CompileConfig(hardware=hardware, check_rank_consistency=False),
    }
    reduce = full.has_blocks and full.layers > 2
    copies = _Copies(full.layers, reduce, [], [], [], [], [])
    param_dtype = layout.mp_policy.param_dtype
    for n in (1, 2) if reduce else (None,):
        what = f"a {n}-block copy" if n else "the model"
        step(f"compiling {what} through the pipeline")
        model, args, loss_fn, how = reduced_copy(factory, n, call) if n else (*call(factory), "")
        copies.figures.append(_compile_and_measure(model, args, loss_fn, mesh, compile_kwargs, tp_mesh, full.tp_plan))
        local = " (one TP rank's share)" if tp_mesh is not None else ""
        step(f"playing one step of {what}{local} on the meta device ({layout.attention} attention, AC {ac_used})")
        model, args, loss_fn, how = reduced_copy(factory, n, call) if n else (*call(factory), "")
        if tp_mesh is not None:
            copies.tp_left = tp_local_copy(model, full.tp_plan, layout.tp)
        copies.traces.append(
            trace_step(model, args, loss_fn, attention=layout.attention, ac=ac_used, param_dtype=param_dtype)
        )
        if tp_mesh is not None:  # the unsplit model's FLOPs, for MFU
            model, args, loss_fn, _ = reduced_copy(factory, n, call) if n else (*call(factory), "")
            copies.full_traces.append(
                trace_step(model, args, loss_fn, attention=layout.attention, ac=ac_used, param_dtype=param_dtype)
            )
        copies.hows.append(how)
    return copies


def _kept_for_backward(kept, copies: _Copies, numel: dict[str, int]) -> int:
    """Gathered bytes the kept buckets hold from forward to backward: what the copies' backward gathers of them
    (of a block the copies cut off, what they gather of their first block); the copies were compiled without it."""
    if kept is None:
        return 0
    regathered = copies.figures[-1].backward_gathers
    first_block = regathered.get(next((b for b in numel if b), ""), 0)
    return sum(regathered.get(b, first_block) for b in kept.buckets)


def _communication(copies: _Copies, shard_size: int, kept_bytes: int) -> _Communication:
    """Bytes on the wire per step (less the kept buckets' backward all-gathers) and TP's collectives per block
    (2 blocks minus 1) and per step, by graph and kind."""
    figures = copies.figures
    wire = copies.extrapolate([g.comm_wire for g in figures])
    wire -= (shard_size - 1) / shard_size * kept_bytes
    buffers = {k: int(copies.extrapolate([g.buffers.get(k, 0) for g in figures])) for k in figures[-1].buffers}
    tp_per_layer: dict[str, dict[str, int]] = {}
    tp_per_step: dict[str, dict[str, int]] = {}
    for g, k in sorted({(g, k) for f in figures for g, k, _, _ in f.tp_collectives}):
        counts = [f.tp_counts(g, k) for f in figures]
        tp_per_step.setdefault(g, {})[k] = int(copies.extrapolate(counts))
        tp_per_layer.setdefault(g, {})[k] = (
            counts[1] - counts[0] if copies.reduce else counts[0] // max(copies.layers, 1)
        )
    tp_wire = copies.extrapolate([f.tp_wire for f in figures])
    tp_buffers = {
        k: int(copies.extrapolate([f.tp_buffers.get(k, 0) for f in figures]))
        for k in sorted({k for f in figures for k in f.tp_buffers})
    }
    return _Communication(wire, buffers, tp_wire, tp_buffers, tp_per_layer, tp_per_step)


def _memory(full: _FullModel, copies: _Copies, fused: bool | str, kept_bytes: int) -> dict[str, int]:
    """Per-rank bytes: sharded state, gathered buckets, activations (with the kept buckets) and the step's peak."""
    measured, numel = full.measured, full.numel
    root = full.buckets.get("", 0)
    others = sorted((b for name, b in full.buckets.items() if name), reverse=True)
    gathered_peak = root + sum(others[:2])
    activations = copies.extrapolate([t.saved_bytes(fused) for t in copies.traces]) + kept_bytes
    grad_buffers = (
        2
        * max((numel[b] for b in numel if b), default=0)
        * (_itemsize(full.param_dtype) + _itemsize(full.reduce_dtype))
    )
    static = measured["params"] + measured["optimizer"]
    peak_alloc = kept_bytes + copies.extrapolate(
        [
            memory_peak(
                t,
                fused,
                static=static,
                grads=measured["grads"],
                gathered_forward=gathered_peak,
                gathered_backward=gathered_peak,
                grad_buffers=grad_buffers,
            )
            for t in copies.traces
        ]
    )
    optimizer_point = static + measured["grads"] + measured["optimizer"] // ADAMW_STATES
    per_rank = {
        "params": measured["params"],
        "grads": measured["grads"],
        "optimizer": measured["optimizer"],
        "gathered_peak": int(gathered_peak),
        "activations": int(activations),
    }
    per_rank["total"] = sum(per_rank.values())
    per_rank["peak"] = int(max(peak_alloc, optimizer_point))
    return per_rank


def _tp_phase_seconds(figures: list[_GraphFigures], dev, ac_used: str) -> tuple[list[float], list[float]]:
    """Each copy's seconds of TP's collectives on the intra-node link in forward and in backward (full AC replays
    forward's in backward)."""

    def tp_time(f: _GraphFigures, graph: str) -> float:
        return sum(
            tp_collective_s(k, b, g, dev.intra_node_alpha_s, dev.intra_node_bytes_per_s)
            for gk, k, b, g in f.tp_collectives
            if gk == graph
        )

    forward = [tp_time(f, "forward") for f in figures]
    backward = [tp_time(f, "backward") + (tp_time(f, "forward") if ac_used == "full" else 0.0) for f in figures]
    return forward, backward


def _step_comm(name: str, layout: Layout, full: _FullModel, copies: _Copies, kept) -> tuple[StepComm, set[int]]:
    """Seconds of each bucket's all-gather and gradient reduction on the profile's link, the blocks the copies
    stand for (the rest with the root), and which of those blocks stay gathered."""
    prof, dev = PROFILES[name], device_for(name)
    shard_size, replicate, numel, buckets = layout.shard_size, layout.replicate, full.numel, full.buckets
    reduce_itemsize = _itemsize(full.reduce_dtype)

    def coll(nbytes: float, group: int, factor: float = 1.0) -> float:
        return prof.alpha_s + factor * (group - 1) / group * nbytes * prof.beta_s_per_byte if group > 1 else 0.0

    # gloo's reduce-scatter is an all-reduce (the device's factor), except over two ranks, where the pipeline
    # runs it as an all-to-all (passes/reduce_scatter_by_all_to_all.py): a ring's bytes
    rs_factor = 1.0 if shard_size == 2 else dev.reduce_scatter_factor

    def reduce_s(b: str) -> float:
        t = coll(numel[b] * reduce_itemsize, shard_size, rs_factor)
        return t + coll(numel[b] // shard_size * reduce_itemsize, replicate, 2.0)

    block_names = [b for b in numel if b]
    n_blocks = copies.layers if copies.reduce else 0  # unreduced: one forward and one backward beside all collectives
    per_block = block_names[:n_blocks]
    kept_blocks = {i for i, b in enumerate(per_block) if kept is not None and b in kept.buckets}
    comm = StepComm(
        root_gather_s=coll(buckets.get("", 0), shard_size)
        + sum(coll(buckets[b], shard_size) for b in block_names[n_blocks:]),
        root_reduce_s=(reduce_s("") if "" in numel else 0.0) + sum(reduce_s(b) for b in block_names[n_blocks:]),
        gather_s=[coll(buckets[b], shard_size) for b in per_block],
        reduce_s=[reduce_s(b) for b in per_block],
    )
    return comm, kept_blocks


def _profile_figures(
    name: str,
    layout: Layout,
    full: _FullModel,
    copies: _Copies,
    kept,
    ac_used: str,
    model_flops: float,
    peak_alloc: int,
) -> _ProfileFigures:
    """Step time, exposed communication, tokens/s, MFU, reserved peak and compute seconds on one profile."""
    dev = device_for(name)
    fused = _FUSED[layout.compiler]
    phases = [phase_times(t, dev, fused) for t in copies.traces]
    fw_block, fw_rest = copies.split([p.forward for p in phases])
    bw_block, bw_rest = copies.split([p.backward for p in phases])
    # TP's collectives, on the critical path (the next op needs their result): added to the phase they run in
    tp_fw, tp_bw = _tp_phase_seconds(copies.figures, dev, ac_used)
    tp_fw_block, tp_fw_rest = copies.split(tp_fw)
    tp_bw_block, tp_bw_rest = copies.split(tp_bw)
    tp_s = tp_fw_rest + tp_bw_rest + (copies.layers * (tp_fw_block + tp_bw_block) if copies.reduce else 0.0)
    comm, kept_blocks = _step_comm(name, layout, full, copies, kept)
    run_s, exposed_s = forward_backward_time(
        fw_block + tp_fw_block,
        fw_rest + tp_fw_rest,
        bw_block + tp_bw_block,
        bw_rest + tp_bw_rest,
        comm,
        dev.comm_overlaps_compute,
        prefetch=max(layout.prefetch, 1),
        reshard=layout.reshard_after_forward is not False,
        kept=kept_blocks,
    )
    exposed_s += tp_s  # counted as compute above
    measured = full.measured
    opt_s = optimizer_time(measured["params"], measured["grads"], measured["optimizer"], dev)
    step_s = run_s + opt_s
    layers, reduce = copies.layers, copies.reduce
    return _ProfileFigures(
        step_s=step_s,
        exposed_s=exposed_s,
        tokens_per_s=full.tokens / layout.tp / step_s,
        mfu=model_flops / step_s / dev.peak_flops,
        reserved=int(peak_alloc * dev.allocator_factor + dev.runtime_bytes),
        compute={
            "forward": fw_rest + layers * fw_block if reduce else fw_rest,
            "backward": bw_rest + layers * bw_block if reduce else bw_rest,
            "optimizer": opt_s,
        },
        tp_s=tp_s,
    )


def _method(layout: Layout, full: _FullModel, copies: _Copies, ac_used: str, kept) -> str:
    """How the plan's figures were obtained, in words."""
    method = (
        f"full model ({full.params:,} params"
        + (f", {full.layers} blocks in '{full.block_path}'" if full.has_blocks else "")
        + ") sharded with shard() for the per-rank parameter / gradient / optimizer bytes; collectives from "
        f"the pipeline's graphs of {copies.reduction}; activations, compute and the peak from one step of the "
        f"same {'copies' if copies.reduce else 'model'} played op by op on the meta device ({layout.attention} "
        f"attention, activation checkpointing {ac_used}, {layout.compiler} kernels), scheduled with FSDP's "
        f"prefetch of {layout.prefetch} block(s)"
    )
    if full.given_ac and layout.ac != "none":
        method += f"; --ac {layout.ac} ignored: the factory's model is already checkpointed"
    if kept is not None:
        method += (
            "; selective unsharding decided on the full model's buckets (blocks in order, then the root), "
            "its kept buckets' backward all-gathers taken out of the bytes and the schedule and their "
            "gathered bytes added to activations and the peak for the whole step"
        )
    if layout.replicate > 1:
        method += (
            f"; HSDP: parameters sharded over {layout.shard_size} ranks, replicated {layout.replicate} times, "
            f"gradients reduce-scattered over {layout.shard_size} ranks then all-reduced over "
            f"{layout.replicate}"
        )
    if layout.tp > 1:
        method += (
            f"; tensor parallel {layout.tp}: {full.tp_text}, applied with parallelize_module before shard "
            "over dp; TP's collectives from the same graphs, counted apart from FSDP's and timed on the "
            "intra-node link on the critical path (in step time and exposed communication)"
            + ("; full AC replays forward's in backward" if ac_used == "full" else "")
            + "; compute and activations of one TP rank (column-wise Linears out/tp, row-wise in/tp)"
            + (f", left whole: {', '.join(copies.tp_left)}" if copies.tp_left else "")
            + "; MFU: the unsplit model's FLOPs / tp per rank; tokens/s per rank: the dp rank's tokens / tp"
        )
    return method


def make_plan(
    factory: Callable,
    layout: Layout,
    *,
    call: Callable = lambda f, **kw: f(**kw),
    profiles: list[str] | None = None,
    progress: Callable[[str], object] | None = None,
) -> Plan:
    """Plan `factory`'s model at `layout`. Needs the default process group of `layout.world_size` ranks (the fake
    one); `call(factory, **kwargs)` builds `(model, args, loss_fn)` (the CLI's checked call); `profiles`: the
    device profiles to time the step on (default: all of PROFILES); `progress(message)` is told each phase."""
    profiles = profiles or list(PROFILES)
    step = progress or (lambda msg: None)
    meshes = plan_meshes(layout.world_size, layout.replicate, layout.tp)

    full = _shard_full_model(factory, layout, call, meshes, step)
    kept = _kept_decision(layout, full)
    ac_used = "as given" if full.given_ac else layout.ac
    copies = _compile_and_trace_copies(factory, layout, call, meshes, full, ac_used, profiles[0], step)

    kept_bytes = _kept_for_backward(kept, copies, full.numel)
    comm = _communication(copies, layout.shard_size, kept_bytes)
    per_rank = _memory(full, copies, _FUSED[layout.compiler], kept_bytes)
    model_flops = 3 * copies.extrapolate([t.forward_flops() for t in (copies.full_traces or copies.traces)]) / layout.tp
    times = {
        name: _profile_figures(name, layout, full, copies, kept, ac_used, model_flops, per_rank["peak"])
        for name in profiles
    }

    assumptions = {
        "attention": layout.attention,
        "ac": ac_used,
        "mp": {
            "param_dtype": str(full.param_dtype).removeprefix("torch."),
            "reduce_dtype": str(full.reduce_dtype).removeprefix("torch."),
        },
        "compiler": layout.compiler,
        "prefetch_blocks": layout.prefetch,
        "reshard_after_forward": layout.reshard_after_forward is not False,
        "tokens_per_step_per_rank": full.tokens,
        "model_flops_per_step_per_rank": model_flops,
        "optimizer": "AdamW, fp32 states",
        "reduction": copies.reduction,
        "tp": layout.tp,
        "keep_gathered": layout.keep_gathered,
        "memory_budget_bytes": layout.memory_budget_bytes,
    }
    shard_size = layout.shard_size
    return Plan(
        layout.world_size,
        full.params,
        full.layers,
        per_rank,
        full.analytical,
        int(comm.wire),
        comm.buffers,
        {n: t.step_s for n, t in times.items()},
        {n: t.exposed_s for n, t in times.items()},
        _method(layout, full, copies, ac_used, kept),
        full.buckets,
        layout.replicate,
        {n: t.tokens_per_s for n, t in times.items()},
        {n: t.mfu for n, t in times.items()},
        {n: t.reserved for n, t in times.items()},
        {n: t.compute for n, t in times.items()},
        assumptions,
        tp=layout.tp,
        tp_plan=full.tp_text,
        tp_comm_bytes_per_step=int(comm.tp_wire),
        tp_collective_buffer_bytes=comm.tp_buffers,
        tp_collectives_per_layer=comm.tp_per_layer,
        tp_collectives_per_step=comm.tp_per_step,
        tp_comm_s={n: t.tp_s for n, t in times.items()} if layout.tp > 1 else {},
        kept_gathered={}
        if kept is None
        else {
            "buckets": list(kept.buckets),
            "bytes": kept.kept_bytes,
            "budget": kept.budget,
            "resharded_bytes": kept.resharded_bytes,
            "kept_for_backward_bytes": kept_bytes,
            "backward_gather_bytes_saved": int((shard_size - 1) / shard_size * kept_bytes),
        },
    )


def _col(n: float) -> str:
    return f"{size_text(n):>13}"


def format_plan(plan, seconds: float, rss: int) -> str:
    pr, an = plan.per_rank_bytes, plan.analytical_bytes
    header = f"plan: {plan.params:,} parameters, {plan.layers} blocks, world size {plan.world_size}"
    if plan.replicate > 1 and plan.tp == 1:
        header += f", mesh {plan.replicate} x {plan.shard_size} (replicate x shard)"
    elif plan.tp > 1:
        header += (
            f", mesh {plan.replicate} x {plan.shard_size} x {plan.tp} (replicate x dp x tp)"
            if plan.replicate > 1
            else f", mesh {plan.shard_size} x {plan.tp} (dp x tp)"
        )
    divisor = "N" if plan.replicate == 1 else "(N/R)"
    if plan.tp > 1:
        divisor = "(dp*tp), /dp untouched by TP"
    out = [header, "", "per-rank memory (rank 0, the largest shard)"]
    for key in ("params", "grads", "optimizer"):
        error = (pr[key] - an[key]) / an[key] * 100 if an[key] else 0.0
        out.append(f"  {key:<14}{_col(pr[key])}   analytical numel*bytes/{divisor} {_col(an[key])}  ({error:+.3f}%)")
    out.append(f"  {'gathered_peak':<14}{_col(pr['gathered_peak'])}   root bucket + 2 largest block buckets")
    out.append(f"  {'activations':<14}{_col(pr['activations'])}   saved by forward for backward")
    out.append(f"  {'total':<14}{_col(pr['total'])}   sum of the above")
    if "peak" in pr:
        out.append(
            f"  {'peak':<14}{_col(pr['peak'])}   highest allocated point of the simulated step (transients included)"
        )
    out.append("")
    buffers = ", ".join(f"{k} {size_text(v)}" for k, v in sorted(plan.collective_buffer_bytes.items()))
    ring = (
        "(N-1)/N of the buffers"
        if plan.replicate == 1
        else (
            f"(G-1)/G of each buffer, 2(G-1)/G of an all-reduce's; G = its group, "
            f"{plan.shard_size} or {plan.replicate} ranks"
        )
    )
    out.append(
        f"communication per step: {size_text(plan.comm_bytes_per_step)} sent per rank ({ring}: {buffers})"
        + (" (FSDP's, over dp)" if plan.tp > 1 else "")
    )
    if plan.kept_gathered:
        from fsdp2_compile.compiler.selective_unshard import KeptGathered

        k = plan.kept_gathered
        decision = KeptGathered(tuple(k["buckets"]), k["bytes"], k["resharded_bytes"], k["budget"])
        out.append(
            f"{decision.summary(size_text)}: {size_text(k['kept_for_backward_bytes'])} of them held from "
            f"forward to backward, {size_text(k['backward_gather_bytes_saved'])} less sent per rank per step"
        )
    if plan.tp > 1:

        def kinds(d: dict) -> str:
            return ", ".join(f"{k} x{n:,}" for k, n in sorted(d.items())) or "none"

        tp_buffers = ", ".join(f"{k} {size_text(v)}" for k, v in sorted(plan.tp_collective_buffer_bytes.items()))
        out.append(f"tensor parallel {plan.tp}: {plan.tp_plan}")
        for graph in ("forward", "backward"):
            out.append(
                f"  {graph:<9} per layer: {kinds(plan.tp_collectives_per_layer.get(graph, {}))}; per step: "
                f"{kinds(plan.tp_collectives_per_step.get(graph, {}))}"
            )
        out.append(
            f"  {size_text(plan.tp_comm_bytes_per_step)} sent per rank per step ((T-1)/T of each buffer, "
            f"2(T-1)/T of an all-reduce's, T = {plan.tp}: {tp_buffers or 'none'}), on the intra-node link, "
            "on the critical path (TP comm below)"
        )
    if plan.assumptions:
        a = plan.assumptions
        out.append(
            f"assumed: {a['attention']} attention, activation checkpointing {a['ac']}, {a['compiler']} "
            f"kernels, params {a['mp']['param_dtype']} / reduce {a['mp']['reduce_dtype']}, "
            f"{a['tokens_per_step_per_rank']:,} tokens per rank per step"
        )
    out.append("")
    out.append(
        f"  {'profile':<20}{'step time':>12}{'exposed comm':>14}{'tokens/s/rank':>15}{'MFU':>7}"
        f"{'reserved peak':>15}" + (f"{'TP comm':>12}" if plan.tp_comm_s else "")
    )
    for name, t in plan.step_time_s.items():
        tps, mfu = plan.tokens_per_s_per_rank.get(name), plan.mfu.get(name)
        reserved = plan.peak_reserved_bytes.get(name)
        out.append(
            f"  {name:<20}{t * 1e3:>9.1f} ms{plan.exposed_comm_s[name] * 1e3:>11.1f} ms"
            + (f"{tps:>15,.0f}" if tps is not None and tps >= 100 else f"{tps:>15.3g}" if tps is not None else "")
            + (f"{mfu * 100:>6.1f}%{size_text(reserved):>15}" if mfu is not None else "")
            + (f"{plan.tp_comm_s[name] * 1e3:>9.1f} ms" if name in plan.tp_comm_s else "")
        )
    out.append("")
    out.append("profiles (cost model: alpha, link, FLOP/s, memory; source)")
    for name in plan.step_time_s:
        p = PROFILES[name]
        out.append(
            f"  {name}: {p.alpha_s * 1e6:.0f} us, {1 / p.beta_s_per_byte / 1e9:.3g} GB/s, "
            f"{p.flops_per_s / 1e12:.3g} TFLOP/s, {p.mem_bytes_per_s / 1e9:.3g} GB/s; {p.source}"
        )
        d = device_for(name)
        eff = ", ".join(f"{k} {v:.2f}" for k, v in d.efficiency.items())
        out.append(
            f"    planner: peak {d.peak_flops / 1e12:.4g} TFLOP/s, memory {d.mem_bytes_per_s / 1e9:.4g} GB/s, "
            f"efficiency {eff}"
            + (
                f", intra-node link {d.intra_node_bytes_per_s / 1e9:.3g} GB/s {d.intra_node_alpha_s * 1e6:.0f} us (TP)"
                if plan.tp > 1
                else ""
            )
            + "; sources in --json (profiles.<name>.device.sources)"
        )
    out.append("")
    out.append(f"method: {plan.method}")
    out.append(f"planner: {seconds:.1f} s wall, peak RSS {rss / 2**20:.0f} MiB")
    return "\n".join(out) + "\n"
