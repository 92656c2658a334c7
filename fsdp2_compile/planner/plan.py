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
- pipeline parallelism (`pp` > 1, `pipeline.py`): the mesh is (pp, [replicate,] dp [, tp]); the copies are compiled
  and played for one micro-batch, their figures split into a block's, the embedding's (first stage) and the
  head's (last stage) by where each op ran (`OpRecord.part`); each pp rank's memory from its stages' parameters
  of the full model's shard, the figures shown are the rank with the highest peak; FSDP's collectives per step
  from its buckets (one gather and one reduction: torch's schedules keep a stage gathered until its last
  micro-batch).
- float8 (`float8`): gathered bytes of the blocks' Linear weights at 1 byte, their matmuls at the float8 peak
  (`step_model.op_seconds`); the graphs' all-gather bytes less the difference.
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
    pp: int = 1
    """Pipeline-parallel degree: the mesh is pp x (replicate x) shard (x tp); 1 = no pipeline."""
    pp_schedule: str = ""
    microbatches: int = 1
    stages_per_rank: int = 1
    pp_stage_blocks: list[int] = field(default_factory=list)
    """Blocks of each pipeline stage (the first also holds the embedding, the last the head)."""
    pp_rank: int = 0
    """The pp rank whose memory per_rank_bytes shows (the highest peak)."""
    bubble_s: dict[str, float] = field(default_factory=dict)
    """Per profile: the pipeline's fill and drain per step (in step_time_s)."""
    pp_comm_s: dict[str, float] = field(default_factory=dict)
    """Per profile: stage-to-stage sends on the critical path per step (in step_time_s and exposed_comm_s)."""
    float8: bool = False
    """float8 training: the blocks' Linear weights gathered in float8, their matmuls at the float8 peak."""

    @property
    def shard_size(self) -> int:
        """Ranks each parameter is sharded over by FSDP: world_size / (pp x replicate x tp)."""
        return self.world_size // (self.pp * self.replicate * self.tp)

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
            "pp": self.pp,
            "pp_schedule": self.pp_schedule,
            "microbatches": self.microbatches,
            "stages_per_rank": self.stages_per_rank,
            "pp_stage_blocks": self.pp_stage_blocks,
            "pp_rank": self.pp_rank,
            "bubble_s": self.bubble_s,
            "pp_comm_s": self.pp_comm_s,
            "float8": self.float8,
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
    fsdp_collectives: list[tuple[str, Role, str, tuple[str, ...], int, int]] = field(default_factory=list)
    """FSDP's collectives in graph order: (graph kind, collective kind, bucket, parameter names, full buffer bytes,
    element size); with `param_rows`, what the search derives them from at another dp split."""
    param_rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Each managed parameter's (rows FSDP shards, elements per row of its shard)."""
    tp_graphs: list[int] = field(default_factory=list)
    """How many of `tp_collectives` each compiled graph holds, in order (`tp_wire` is summed graph by graph)."""

    def tp_counts(self, graph: str, kind: str) -> int:
        return sum(1 for g, k, _, _ in self.tp_collectives if g == graph and k == kind)


def _compile_and_measure(model, args, loss_fn, mesh, compile_kwargs, tp_mesh=None, tp_plan=None) -> _GraphFigures:
    """Bytes on the wire and collective buffers of the pipeline's final forward and backward graphs (FSDP's; TP's
    apart when `tp_mesh` is given and `tp_plan` is applied to the blocks first)."""
    from fsdp2_compile._torch_private import group_size
    from fsdp2_compile.api import make_backend
    from fsdp2_compile.runtime.sharding import managed_params

    unwrap_checkpointing(model)  # checkpointing changes no collective
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, tp_plan)
    shard_for_plan(
        model,
        mesh=mesh,
        reshard_after_forward=compile_kwargs["reshard_after_forward"],
        mp_policy=compile_kwargs["mp_policy"],
    )
    figures = _GraphFigures(0.0, {})
    for name, p, info in managed_params(model):
        figures.param_rows[name] = (info.dim0, math.prod((p.to_local() if isinstance(p, DTensor) else p).shape[1:]))
    clear_compiled_graphs()
    torch.compiler.reset()  # the copies are throwaway; without it a process that plans often hits recompile_limit
    # torch.compile on the sharded meta model directly: shard_compile's call wrapper refuses meta parameters
    # (a user's forward must not run on them), and the planner only needs the graphs
    compiled = torch.compile(model, backend=make_backend(compile_kwargs["compile_config"]))
    loss_fn(compiled(*args)).backward()
    records = [r for r in compiled_graphs() if r.kind in ("forward", "backward")]
    for r in records:
        figures.tp_graphs.append(len(figures.tp_collectives))
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
            if c is not None and not is_tp(node):
                figures.fsdp_collectives.append(
                    (r.kind, c.kind, node.meta.get(BUCKET, ""), c.params, c.nbytes, c.dtype.itemsize)
                )
            if c is not None and is_tp(node):
                figures.tp_collectives.append(
                    (r.kind, str(c.kind), c.nbytes, group_size(CollectiveArgs.of(node).group_name))
                )
            elif c is not None and r.kind == "backward" and c.kind == Role.ALL_GATHER:
                bucket = node.meta.get(BUCKET, "")
                figures.backward_gathers[bucket] = figures.backward_gathers.get(bucket, 0) + c.nbytes
        figures.tp_graphs[-1] = len(figures.tp_collectives) - figures.tp_graphs[-1]
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
    pp: int = 1
    """Pipeline-parallel degree (P, `pipeline.py`): the mesh is (pp, [replicate,] dp [, tp]) and the blocks split
    into P x V stages (the embedding with the first, the head and the loss with the last); 1 = no pipeline."""
    microbatches: int | None = None
    """Micro-batches per step under pp (M), dividing the local batch (dim 0 of the factory's inputs); None:
    torchtitan's default, micro-batches of one sample (M = the local batch)."""
    pp_schedule: str = "1F1B"
    """The pipeline schedule: "1F1B", "GPipe" or "Interleaved1F1B" (`pipeline.SCHEDULES`)."""
    stages_per_rank: int | None = None
    """Stages each pp rank runs (V); None: 1, or 2 for Interleaved1F1B (torchtitan's default)."""
    float8: bool = False
    """torchao float8 training with float8 all-gather: the blocks' Linear weights gathered as float8 (1 byte an
    element), their matmuls at the device's float8 peak; needs bf16 parameters (mp_policy param_dtype)."""

    def __post_init__(self) -> None:
        for name, what in (
            ("world_size", "a number of ranks"),
            ("replicate", "a number of replicas (1: no HSDP)"),
            ("tp", "a tensor-parallel degree (1: no TP)"),
            ("pp", "a pipeline-parallel degree (1: no PP)"),
        ):
            if not _is_count(getattr(self, name)):
                raise ValueError(f"Layout.{name}={getattr(self, name)!r}: use {what}, a whole number >= 1")
        if self.world_size % (self.pp * self.replicate * self.tp):
            pp = f"pp {self.pp} x " if self.pp > 1 else ""
            raise ValueError(
                f"Layout.world_size={self.world_size} is not a multiple of {pp}replicate {self.replicate} x tp "
                f"{self.tp}: the mesh is {'pp x ' if pp else ''}replicate x shard x tp; pass a world_size that is a "
                f"multiple of {self.pp * self.replicate * self.tp}, or degrees whose product divides "
                f"{self.world_size}"
            )
        self._check_pipeline()
        if self.float8 is not False and (self.float8 is not True or self.mp_policy.param_dtype != torch.bfloat16):
            raise ValueError(
                f"Layout.float8={self.float8!r} with param_dtype {self.mp_policy.param_dtype}: float8 training "
                "(True) needs bf16 parameters; pass mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                "reduce_dtype=torch.float32) (--mp bf16)"
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

    def _check_pipeline(self) -> None:
        from fsdp2_compile.planner.pipeline import SCHEDULES

        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"Layout.pp_schedule={self.pp_schedule!r} is not one of: {', '.join(SCHEDULES)}")
        for name in ("microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if value is not None and not _is_count(value):
                raise ValueError(f"Layout.{name}={value!r}: use a whole number >= 1, or None for the default")
            if value is not None and self.pp == 1:
                raise ValueError(f"Layout.{name}={value!r} without pipeline parallelism: pass pp > 1 or leave it None")
        interleaved = self.pp_schedule == "Interleaved1F1B"
        if self.stages_per_rank is not None and (self.stages_per_rank >= 2) != interleaved:
            raise ValueError(
                f"Layout.stages_per_rank={self.stages_per_rank} with {self.pp_schedule}: "
                + ("Interleaved1F1B runs 2 or more stages per rank" if interleaved else "use 1 (or Interleaved1F1B)")
            )
        if self.pp > 1 and (self.keep_gathered is not None or self.memory_budget_bytes is not None):
            raise ValueError(
                "Layout.keep_gathered / memory_budget_bytes with pp > 1: the pipeline keeps each stage's parameters "
                "gathered for the whole step already (torch's schedules reshard after the last micro-batch); "
                "leave them None"
            )

    @property
    def shard_size(self) -> int:
        """Ranks each parameter is sharded over by FSDP: world_size / (pp x replicate x tp)."""
        return self.world_size // (self.pp * self.replicate * self.tp)

    @property
    def v(self) -> int:
        """Stages per pp rank."""
        return self.stages_per_rank or (2 if self.pp_schedule == "Interleaved1F1B" else 1)


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
    rows: list[_ParamRow] = field(default_factory=list)
    """Each managed parameter: its pipeline part, bucket and bytes."""
    local_batch: int = 1
    """Dim 0 of the factory's tensor inputs (what micro-batches split)."""
    facts: _ShardFacts | None = None
    """The parameters' shapes the figures above come from, for the same model at another dp split (the search)."""


@dataclass
class _ShardFacts:
    """The full model's parameters as the figures of `_FullModel` read them, independent of the dp split: each
    unique parameter (nbytes, tensor-parallel sharded, requires_grad, numel) before sharding, the same by name, and
    each managed parameter after it (`_ManagedFact`)."""

    unique: list[tuple[int, bool, bool, int]]
    named: list[tuple[str, int, bool, bool, int]]
    managed: list[_ManagedFact]
    float_dtype: torch.dtype
    """The first floating-point parameter's dtype (the compute dtype without a param_dtype)."""


@dataclass(frozen=True)
class _ManagedFact:
    name: str
    bucket: str
    dim0: int
    """The rows FSDP shards (TP-local under tensor parallelism)."""
    trailing: int
    """Elements per row of this rank's shard."""
    itemsize: int
    requires_grad: bool
    block: int | None
    """Index in the block list, None outside it."""
    linear: bool
    """A Linear's weight."""
    global_numel: int
    resharded: bool
    """Resharded after forward, as sharded for the facts."""


@dataclass
class _ParamRow:
    """One managed parameter of the full model, sharded at the layout (rank 0)."""

    part: int | str
    """The block index it belongs to, or "first" / "last" (used before / after the blocks in forward)."""
    bucket: str
    numel: int
    """Full padded elements its all-gather gathers."""
    gathered_bytes: int
    """Bytes gathered: numel x the compute dtype's size (float8 Linear weights: 1)."""
    local: dict[str, int]
    """This rank's bytes of parameter, gradient and AdamW state."""
    analytical: dict[str, float]


def _outside_parts(factory: Callable, call: Callable) -> dict[str, str]:
    """Each parameter outside the block list by name: "first" when its module runs before the first block in
    forward, else "last" (a 1-block copy run forward on meta; a parameter that never runs: "first")."""
    model, args, _, _ = reduced_copy(factory, 1, call)
    path, blocks = block_list(model)
    ran, parts, hooks = [False], {}, []
    hooks.append(blocks[0].register_forward_pre_hook(lambda *_: ran.__setitem__(0, True)))
    for name, module in model.named_modules():
        if name == path or name.startswith(f"{path}."):
            continue
        own = [n for n, _ in module.named_parameters(recurse=False)]

        def record(_module, _args, own=own, name=name):
            for n in own:
                parts.setdefault(f"{name}.{n}" if name else n, "last" if ran[0] else "first")

        if own:
            hooks.append(module.register_forward_pre_hook(record))
    with torch.no_grad():
        model.to("meta")(*args)
    for hook in hooks:
        hook.remove()
    return parts


def _param_rows(model, path: str, outside: dict[str, str], analytical: dict, itemsize: int, float8: bool):
    """`_ParamRow` of each managed parameter of the sharded `model` (block list at `path`)."""
    from fsdp2_compile.core.ops import padded_rows
    from fsdp2_compile.runtime.sharding import managed_params

    rows = []
    for name, p, info in managed_params(model):
        local = p.to_local() if isinstance(p, DTensor) else p
        numel = padded_rows(info.dim0, info.world_size) * info.world_size * math.prod(local.shape[1:])
        owner, _, attr = name.rpartition(".")
        in_block = path and name.startswith(f"{path}.")
        part = int(name[len(path) + 1 :].split(".")[0]) if in_block else outside.get(name, "first")
        linear = attr == "weight" and isinstance(model.get_submodule(owner), nn.Linear)
        size = 1 if float8 and in_block and linear else itemsize
        state = {
            "params": nbytes(local),
            "grads": nbytes(local) if p.requires_grad else 0,
            "optimizer": ADAMW_STATES * 4 * local.numel() if p.requires_grad else 0,
        }
        rows.append(_ParamRow(part, info.bucket, numel, numel * size, state, analytical[name]))
    return rows


def _analytical_by_name(model: nn.Module, world_size: int, tp: int) -> dict[str, dict[str, float]]:
    """`analytical_bytes`' figures of each parameter, by name (before sharding)."""
    out = {}
    for name, p in model.named_parameters():
        ranks = world_size * tp if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements) else world_size
        grad = p.requires_grad
        out[name] = {
            "params": nbytes(p) / ranks,
            "grads": nbytes(p) / ranks if grad else 0.0,
            "optimizer": ADAMW_STATES * 4 * p.numel() / ranks if grad else 0.0,
        }
    return out


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
    by_name = _analytical_by_name(model, layout.shard_size, layout.tp)
    facts = _ShardFacts(
        [(nbytes(p), _tp_sharded(p), p.requires_grad, p.numel()) for p in _unique_params(model)],
        [(n, nbytes(p), _tp_sharded(p), p.requires_grad, p.numel()) for n, p in model.named_parameters()],
        [],
        next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32),
    )
    local_batch = _check_pipeline_fits(layout, full_args, path, blocks)
    outside = _outside_parts(factory, call) if layout.pp > 1 else {}
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
    rows = _param_rows(
        model, path if blocks is not None else "", outside, by_name, _itemsize(param_dtype), layout.float8
    )
    buckets: dict[str, int] = {}
    for row in rows:
        buckets[row.bucket] = buckets.get(row.bucket, 0) + row.gathered_bytes
    facts.managed = _managed_facts(model, path if blocks is not None else "")
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
        buckets={b: buckets[b] for b in numel},
        resharded=_resharded_sizes(model, _itemsize(param_dtype)),
        param_dtype=param_dtype,
        reduce_dtype=mp_policy.reduce_dtype or param_dtype,
        rows=rows,
        local_batch=local_batch,
        facts=facts,
    )


def _tp_sharded(p) -> bool:
    return isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)


def _managed_facts(model: nn.Module, path: str) -> list[_ManagedFact]:
    """`_ManagedFact` of each managed parameter of the sharded `model` (block list at `path`)."""
    from fsdp2_compile.runtime.sharding import managed_params

    facts = []
    for name, p, info in managed_params(model):
        local = p.to_local() if isinstance(p, DTensor) else p
        owner, _, attr = name.rpartition(".")
        in_block = bool(path) and name.startswith(f"{path}.")
        facts.append(
            _ManagedFact(
                name,
                info.bucket,
                info.dim0,
                math.prod(local.shape[1:]),
                local.element_size(),
                p.requires_grad,
                int(name[len(path) + 1 :].split(".")[0]) if in_block else None,
                attr == "weight" and isinstance(model.get_submodule(owner), nn.Linear),
                math.prod(p.shape),
                bool(info.reshard_after_forward),
            )
        )
    return facts


def _check_pipeline_fits(layout: Layout, args: tuple, path: str, blocks) -> int:
    """The local batch (dim 0 of the factory's tensor inputs); under pp, ValueError unless the model has a block
    list of at least P x V blocks and the micro-batches divide the local batch."""
    dims = {a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 0}
    local_batch = min(dims, default=1)
    if layout.pp == 1:
        return local_batch
    stages = layout.pp * layout.v
    if blocks is None:
        raise ValueError("--pp needs a model with an nn.ModuleList of blocks to split into pipeline stages")
    if stages > len(blocks):
        raise ValueError(
            f"--pp {layout.pp} x {layout.v} stage(s) per rank = {stages} stages, but '{path}' has {len(blocks)} "
            f"blocks: each stage needs a block; pass a smaller --pp or --stages-per-rank"
        )
    m = layout.microbatches or local_batch
    if len(dims) != 1 or local_batch % m:
        raise ValueError(
            f"--microbatches {m} does not divide the local batch: the factory's tensor inputs have dim 0 of "
            f"{sorted(dims)}; pass a --microbatches that divides {local_batch}, or a factory whose inputs share "
            "one batch dim"
        )
    return local_batch


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
    copies = _compile_copies(factory, layout, call, meshes, full, hardware, step)
    _trace_copies(copies, factory, layout, call, full, ac_used, step)
    return copies


def _compile_copies(
    factory: Callable, layout: Layout, call: Callable, meshes: tuple, full: _FullModel, hardware: str, step: Callable
) -> _Copies:
    """The copies' compiled graphs' figures (`_Copies` without traces)."""
    mesh, tp_mesh = meshes
    compile_kwargs = {
        "reshard_after_forward": layout.reshard_after_forward,
        "mp_policy": layout.mp_policy,
        "compile_config": CompileConfig(hardware=hardware, check_rank_consistency=False),
    }
    reduce = full.has_blocks and full.layers > 2
    copies = _Copies(full.layers, reduce, [], [], [], [], [])
    for n in (1, 2) if reduce else (None,):
        what = f"a {n}-block copy" if n else "the model"
        step(f"compiling {what} through the pipeline")
        model, args, loss_fn, how = reduced_copy(factory, n, call) if n else (*call(factory), "")
        args = _microbatch(args, layout, full)
        copies.figures.append(_compile_and_measure(model, args, loss_fn, mesh, compile_kwargs, tp_mesh, full.tp_plan))
        copies.hows.append(how)
    return copies


def _trace_copies(
    copies: _Copies,
    factory: Callable,
    layout: Layout,
    call: Callable,
    full: _FullModel,
    ac_used: str,
    step: Callable,
    unsplit: list[StepTrace] | None = None,
) -> None:
    """Play one step of each copy on the meta device (its ops), into `copies.traces` (and, under TP, the unsplit
    copies into `copies.full_traces`, or `unsplit` when given: the same copies traced without TP)."""
    param_dtype = layout.mp_policy.param_dtype
    for n in (1, 2) if copies.reduce else (None,):
        what = f"a {n}-block copy" if n else "the model"
        local = " (one TP rank's share)" if layout.tp > 1 else ""
        local += " for one micro-batch" if layout.pp > 1 else ""
        step(f"playing one step of {what}{local} on the meta device ({layout.attention} attention, AC {ac_used})")
        model, args, loss_fn, _ = reduced_copy(factory, n, call) if n else (*call(factory), "")
        args = _microbatch(args, layout, full)
        if layout.tp > 1:
            copies.tp_left = tp_local_copy(model, full.tp_plan, layout.tp)
        copies.traces.append(
            trace_step(model, args, loss_fn, attention=layout.attention, ac=ac_used, param_dtype=param_dtype)
        )
        if layout.tp > 1 and unsplit is not None:
            copies.full_traces = list(unsplit)
        elif layout.tp > 1:  # the unsplit model's FLOPs, for MFU
            model, args, loss_fn, _ = reduced_copy(factory, n, call) if n else (*call(factory), "")
            args = _microbatch(args, layout, full)
            copies.full_traces.append(
                trace_step(model, args, loss_fn, attention=layout.attention, ac=ac_used, param_dtype=param_dtype)
            )


def _microbatch(args: tuple, layout: Layout, full: _FullModel) -> tuple:
    """Under pp, the factory's inputs cut to one micro-batch (the first local_batch / M rows of each tensor with
    that batch dim, as torch's pipelining splits them); else as they are."""
    if layout.pp == 1:
        return args
    rows = full.local_batch // (layout.microbatches or full.local_batch)
    return tuple(a[:rows] if isinstance(a, torch.Tensor) and a.dim() > 0 else a for a in args)


def _kept_for_backward(kept, copies: _Copies, numel: dict[str, int]) -> int:
    """Gathered bytes the kept buckets hold from forward to backward: what the copies' backward gathers of them
    (of a block the copies cut off, what they gather of their first block); the copies were compiled without it."""
    if kept is None:
        return 0
    regathered = copies.figures[-1].backward_gathers
    first_block = regathered.get(next((b for b in numel if b), ""), 0)
    return sum(regathered.get(b, first_block) for b in kept.buckets)


def _held_unsharded(layout: Layout, full: _FullModel) -> int:
    """Gathered bytes of the blocks that `reshard_after_forward=False` holds from their forward to their backward
    (as keeping every block gathered does); the copies' traces see one block's at a time."""
    return sum(b for name, b in full.buckets.items() if name) if layout.reshard_after_forward is False else 0


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
    activations = copies.extrapolate([_memo(t, StepTrace.saved_bytes, fused) for t in copies.traces]) + kept_bytes
    grad_buffers = (
        2
        * max((numel[b] for b in numel if b), default=0)
        * (_itemsize(full.param_dtype) + _itemsize(full.reduce_dtype))
    )
    static = measured["params"] + measured["optimizer"]
    peak_alloc = kept_bytes + copies.extrapolate(
        [
            _memo(
                t,
                memory_peak,
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


def _memo(trace: StepTrace, fn: Callable, *args, **kwargs):
    """`fn(trace, *args, **kwargs)`, kept on the trace by its arguments (a trace does not change once played; the
    search evaluates many layouts on one). Devices are module constants, keyed by identity."""
    memo = trace.__dict__.setdefault("_figures_memo", {})
    key = (fn, *(id(a) if hasattr(a, "efficiency") else a for a in args), *sorted(kwargs.items()))
    if key not in memo:
        memo[key] = fn(trace, *args, **kwargs)
    return memo[key]


def _tp_phase_seconds(
    figures: list[_GraphFigures], dev, ac_used: str, float8: bool = False
) -> tuple[list[float], list[float]]:
    """Each copy's seconds of TP's collectives on the intra-node link in forward and in backward (full AC replays
    forward's in backward). float8: forward's all-gathers move float8 activations, half the graphs' bf16 bytes
    (torchao's `PrepareFloat8ModuleInput` casts before the gather; the head's gather, one per step, is counted so too)."""

    def tp_time(f: _GraphFigures, graph: str) -> float:
        return sum(
            tp_collective_s(
                k,
                b / 2 if float8 and graph == "forward" and k == Role.ALL_GATHER else b,
                g,
                dev.intra_node_alpha_s,
                dev.intra_node_bytes_per_s,
            )
            for gk, k, b, g in f.tp_collectives
            if gk == graph
        )

    forward = [tp_time(f, "forward") for f in figures]
    backward = [tp_time(f, "backward") + (tp_time(f, "forward") if ac_used == "full" else 0.0) for f in figures]
    return forward, backward


def _collective_s(prof, nbytes: float, group: int, factor: float = 1.0) -> float:
    """A ring collective over `group` ranks on the profile's link: alpha + factor x (G-1)/G x bytes x beta."""
    return prof.alpha_s + factor * (group - 1) / group * nbytes * prof.beta_s_per_byte if group > 1 else 0.0


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
    # unreduced, the blocks' buckets go with the root: those resharded and not kept are gathered again in backward
    again = [b for b in block_names[n_blocks:] if b in full.resharded and not (kept is not None and b in kept.buckets)]
    comm = StepComm(
        root_gather_s=coll(buckets.get("", 0), shard_size)
        + sum(coll(buckets[b], shard_size) for b in block_names[n_blocks:]),
        root_reduce_s=(reduce_s("") if "" in numel else 0.0) + sum(reduce_s(b) for b in block_names[n_blocks:]),
        gather_s=[coll(buckets[b], shard_size) for b in per_block],
        reduce_s=[reduce_s(b) for b in per_block],
        root_regather_s=sum(coll(buckets[b], shard_size) for b in again),
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
    phases = [_memo(t, phase_times, dev, fused, layout.float8) for t in copies.traces]
    fw_block, fw_rest = copies.split([p.forward for p in phases])
    bw_block, bw_rest = copies.split([p.backward for p in phases])
    # TP's collectives, on the critical path (the next op needs their result): added to the phase they run in
    tp_fw, tp_bw = _tp_phase_seconds(copies.figures, dev, ac_used, layout.float8)
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


def _pipeline_communication(comm: _Communication, layout: Layout, full: _FullModel, rank, m: int) -> None:
    """Replace the copies' per-pass figures by one pp rank's per step: FSDP's collectives of its buckets (gathered
    once, or M + 1 times when resharding after forward; reduced once), TP's of its blocks' share of M
    micro-batches."""
    shard_size, replicate = layout.shard_size, layout.replicate
    gathers = 1 if layout.reshard_after_forward is not True else m + 1
    ri = _itemsize(full.reduce_dtype)
    gathered = gathers * sum(g for g, _ in rank.buckets.values())
    numel = sum(n for _, n in rank.buckets.values())
    comm.buffers = {"all_gather": gathered, "reduce_scatter": numel * ri}
    comm.wire = (shard_size - 1) / shard_size * (gathered + numel * ri)
    if replicate > 1:
        comm.buffers["all_reduce"] = numel // shard_size * ri
        comm.wire += 2 * (replicate - 1) / replicate * numel // shard_size * ri
    share = m * rank.blocks / max(full.layers, 1)
    comm.tp_wire *= share
    comm.tp_buffers = {k: int(v * share) for k, v in comm.tp_buffers.items()}
    comm.tp_per_step = {g: {k: round(n * share) for k, n in d.items()} for g, d in comm.tp_per_step.items()}


def _float8_gather_saving(layout: Layout, full: _FullModel, kept) -> int:
    """Full all-gather buffer bytes per step that float8 Linear weights save over the graphs' compute-dtype
    gathers: each block bucket's saving once in forward and again in backward where it reshards."""
    if not layout.float8:
        return 0
    itemsize = _itemsize(full.param_dtype)
    saved = 0
    for b, n in full.numel.items():
        again = b and layout.reshard_after_forward is not False and not (kept is not None and b in kept.buckets)
        saved += (1 + bool(again)) * (n * itemsize - full.buckets[b])
    return saved


@dataclass
class _PipelineRank:
    """One pp rank's share of the model: its stages' parameters, buckets, time and activations per micro-batch."""

    rank: int
    stages: list[int]
    blocks: int
    local: dict[str, int]
    analytical: dict[str, float]
    buckets: dict[str, tuple[int, int]]
    """Its buckets' (gathered bytes, full elements); the root's share of the stage's own parameters."""
    microbatch_s: float = 0.0
    """Forward + backward (+ TP's collectives) of one micro-batch through its stages."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    tp_s: float = 0.0
    activations: int = 0
    """Activations one micro-batch leaves through its stages for backward."""


def _pipeline_ranks(layout: Layout, full: _FullModel) -> tuple[list[_PipelineRank], list[tuple[int, int]]]:
    """Each pp rank's parameters and buckets under torchtitan's split (`pipeline.stage_blocks`)."""
    from fsdp2_compile.planner.pipeline import rank_stages, stage_blocks

    n_stages = layout.pp * layout.v
    split = stage_blocks(full.layers, n_stages)
    stage_of = {}
    for k, (first, n) in enumerate(split):
        stage_of.update({i: k for i in range(first, first + n)})
    stage_of.update({"first": 0, "last": n_stages - 1})
    ranks = []
    for r in range(layout.pp):
        stages = rank_stages(r, layout.pp, layout.v)
        mine = [row for row in full.rows if stage_of[row.part] in stages]
        buckets: dict[str, tuple[int, int]] = {}
        for row in mine:
            g, n = buckets.get(row.bucket, (0, 0))
            buckets[row.bucket] = (g + row.gathered_bytes, n + row.numel)
        ranks.append(
            _PipelineRank(
                r,
                stages,
                sum(split[k][1] for k in stages),
                {k: sum(row.local[k] for row in mine) for k in ("params", "grads", "optimizer")},
                {k: sum(row.analytical[k] for row in mine) for k in ("params", "grads", "optimizer")},
                buckets,
            )
        )
    return ranks, split


def _part_figures(copies: _Copies, values: list[dict]) -> dict:
    """One block's, the first stage's extra and the last stage's extra figure from per-copy {part: value}: a
    block is the 2-block copy's blocks minus the 1-block copy's (or the unreduced model's over its blocks)."""
    one = values[0]
    block = values[1]["block"] - one["block"] if copies.reduce else one["block"] / max(copies.layers, 1)
    return {"block": block, "first": one["first"], "last": one["last"]}


def _pipeline_figures(
    name: str, layout: Layout, full: _FullModel, copies: _Copies, ranks: list[_PipelineRank], split, ac_used: str
) -> tuple[_ProfileFigures, dict[str, float]]:
    """Step time on one profile under pp, and its bubble, stage sends and the slowest rank."""
    from fsdp2_compile.planner.pipeline import bubble_s, pp_comm_s
    from fsdp2_compile.planner.step_model import part_times

    prof, dev = PROFILES[name], device_for(name)
    fused = _FUSED[layout.compiler]
    m, n_stages = layout.microbatches or full.local_batch, layout.pp * layout.v
    times = [_memo(t, part_times, dev, fused, layout.float8) for t in copies.traces]
    fw = _part_figures(copies, [{p: t.get(("forward", p), 0.0) for p in ("block", "first", "last")} for t in times])
    bw = _part_figures(copies, [{p: t.get(("backward", p), 0.0) for p in ("block", "first", "last")} for t in times])
    tp_fw, tp_bw = _tp_phase_seconds(copies.figures, dev, ac_used, layout.float8)
    if copies.reduce:
        (fw_tp_block, fw_tp_rest), (bw_tp_block, bw_tp_rest) = copies.split(tp_fw), copies.split(tp_bw)
        tp_block, tp_rest = fw_tp_block + bw_tp_block, fw_tp_rest + bw_tp_rest
    else:
        tp_block, tp_rest = (tp_fw[0] + tp_bw[0]) / max(copies.layers, 1), 0.0
    for rank in ranks:
        rank.forward_s = rank.blocks * fw["block"]
        rank.backward_s = rank.blocks * bw["block"]
        rank.tp_s = rank.blocks * tp_block
        if 0 in rank.stages:
            rank.forward_s += fw["first"]
            rank.backward_s += bw["first"]
        if n_stages - 1 in rank.stages:
            rank.forward_s += fw["last"]
            rank.backward_s += bw["last"]
            rank.tp_s += tp_rest
        rank.microbatch_s = rank.forward_s + rank.backward_s + rank.tp_s
    slowest = max(ranks, key=lambda r: r.microbatch_s)
    compute_s = m * slowest.microbatch_s
    bubble = bubble_s(layout.pp, layout.v, slowest.microbatch_s)
    send = prof.alpha_s + copies.traces[0].boundary_bytes * prof.beta_s_per_byte
    stage_comm = pp_comm_s(layout.pp, layout.v, m, send)
    shard_size, replicate = layout.shard_size, layout.replicate
    rs_factor = 1.0 if shard_size == 2 else dev.reduce_scatter_factor
    reduce_itemsize = _itemsize(full.reduce_dtype)
    # torch's schedules keep a stage gathered from its first use until its last micro-batch's backward
    # (reshard_after_backward False before it) and reduce its gradients once; resharding after forward gathers
    # again each micro-batch (M forwards or backwards find it resharded, + 1)
    gathers = 1 if layout.reshard_after_forward is not True else m + 1
    step_s, exposed_s, opt_slowest = 0.0, 0.0, 0.0
    for rank in ranks:
        gather = [_collective_s(prof, g, shard_size) for g, _ in rank.buckets.values()]
        reduce = [
            _collective_s(prof, n * reduce_itemsize, shard_size, rs_factor)
            + _collective_s(prof, n // shard_size * reduce_itemsize, replicate, 2.0)
            for _, n in rank.buckets.values()
        ]
        total = gathers * sum(gather) + sum(reduce)
        if dev.comm_overlaps_compute:  # the first gather and the last reduction wait; the rest runs beside compute
            fsdp_exposed = max(max(gather, default=0.0) + max(reduce, default=0.0), total - compute_s)
        else:
            fsdp_exposed = total
        opt_s = optimizer_time(rank.local["params"], rank.local["grads"], rank.local["optimizer"], dev)
        rank_step = compute_s + bubble + stage_comm + fsdp_exposed + opt_s
        if rank_step > step_s:
            step_s, exposed_s = rank_step, fsdp_exposed + stage_comm + m * slowest.tp_s
            opt_slowest = opt_s
    return (
        _ProfileFigures(
            step_s=step_s,
            exposed_s=exposed_s,
            tokens_per_s=full.tokens / (layout.tp * layout.pp) / step_s,
            mfu=0.0,
            reserved=0,
            compute={"forward": m * slowest.forward_s, "backward": m * slowest.backward_s, "optimizer": opt_slowest},
            tp_s=m * slowest.tp_s,
        ),
        {"bubble_s": bubble, "pp_comm_s": stage_comm, "slowest_rank": slowest.rank},
    )


def _pipeline_memory(layout: Layout, full: _FullModel, copies: _Copies, ranks: list[_PipelineRank], split):
    """Per-rank bytes of the pp rank with the highest peak: its sharded state, its stages gathered for the step,
    the unsharded gradients accumulated over micro-batches (in the reduce dtype, as FSDP2 accumulates them with
    gradient sync off), the activations of the micro-batches in flight, and one micro-batch's transient."""
    from fsdp2_compile.planner.pipeline import in_flight

    fused = _FUSED[layout.compiler]
    m, n_stages = layout.microbatches or full.local_batch, layout.pp * layout.v
    saved = _part_figures(
        copies,
        [{p: _memo(t, StepTrace.saved_bytes, fused, p) for p in ("block", "first", "last")} for t in copies.traces],
    )
    one = copies.traces[0]
    transient = max((b for _, b in _memo(one, StepTrace.liveness, fused)), default=0) - _memo(
        one, StepTrace.saved_bytes, fused
    )
    # a block's figure holds its input (the previous block's output); the first stage's first input is the
    # embedding's, so its last block's output, which only crosses to the next stage, is not held there
    boundary = one.boundary_bytes if n_stages > 1 else 0
    reduce_itemsize, itemsize = _itemsize(full.reduce_dtype), _itemsize(full.param_dtype)
    best = None
    for rank in ranks:
        per_stage = [
            split[k][1] * saved["block"]
            + (saved["first"] - boundary if k == 0 else 0)
            + (saved["last"] if k == n_stages - 1 else 0)
            for k in rank.stages
        ]
        rank.activations = int(sum(per_stage))
        numel = sum(n for _, n in rank.buckets.values())
        if m > 1:
            unsharded_grads = numel * reduce_itemsize
        else:  # one micro-batch: the plain step's gradient buffers (two blocks in flight)
            largest = max((n for b, (_, n) in rank.buckets.items() if b), default=0)
            unsharded_grads = 2 * largest * (itemsize + reduce_itemsize)
        per_rank = {
            **rank.local,
            "gathered_peak": sum(g for g, _ in rank.buckets.values()),
            "unsharded_grads": int(unsharded_grads),
            "activations": int(
                sum(n * a for n, a in zip(in_flight(layout.pp_schedule, layout.pp, layout.v, m, rank.rank), per_stage))
            ),
        }
        per_rank["total"] = sum(per_rank.values())
        per_rank["peak"] = int(per_rank["total"] + transient)
        if best is None or per_rank["peak"] > best[1]["peak"]:
            best = (rank, per_rank)
    return best


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
    if layout.pp > 1:
        method += (
            f"; pipeline parallel {layout.pp} ({layout.pp_schedule}, {layout.v} stage(s) per rank): blocks split as "
            "torchtitan splits them (the embedding and the head count one block each), the copies compiled and "
            "played for one micro-batch; per pp rank its stages' sharded state, its stages gathered for the step "
            "and their gradients accumulated unsharded in the reduce dtype (torch's schedules reshard and reduce "
            "after the last micro-batch; reshard_after_forward False unless given True: torchtitan's pp default), "
            "activations of the micro-batches the schedule holds; step: the slowest rank's micro-batches, the "
            "bubble, the stage sends on the critical path on the profile's link, FSDP's first gather and last "
            "reduction exposed, the optimizer; tokens/s per rank: the dp rank's tokens / (pp x tp)"
        )
    if layout.float8:
        method += (
            "; float8: the blocks' Linear weights gathered in float8 (1 byte an element), their 2-D matmuls at the "
            "device's float8 peak x the matmul efficiency; the head and everything else in bf16; MFU against the "
            "bf16 peak"
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
    for name in profiles if layout.float8 else ():
        if not device_for(name).float8_flops:
            raise ValueError(
                f"float8 on profile {name!r}: the device has no float8 matmul (float8_flops 0); plan float8 on "
                f"one that has, e.g. {', '.join(n for n in PROFILES if device_for(n).float8_flops)}"
            )
    step = progress or (lambda msg: None)
    meshes = plan_meshes(layout.world_size, layout.replicate, layout.tp, layout.pp)

    full = _shard_full_model(factory, layout, call, meshes, step)
    ac_used = "as given" if full.given_ac else layout.ac
    copies = _compile_and_trace_copies(factory, layout, call, meshes, full, ac_used, profiles[0], step)
    return _assemble(layout, full, copies, profiles)


def _assemble(layout: Layout, full: _FullModel, copies: _Copies, profiles: list[str]) -> Plan:
    """The plan's figures from the full model's shard and the copies' graphs and traces: arithmetic only (the
    search evaluates it for every knob combination on stages it shares between layouts)."""
    ac_used = "as given" if full.given_ac else layout.ac
    kept = _kept_decision(layout, full)
    kept_bytes = _kept_for_backward(kept, copies, full.numel)
    comm = _communication(copies, layout.shard_size, kept_bytes)
    model_flops = 3 * copies.extrapolate([t.forward_flops() for t in (copies.full_traces or copies.traces)]) / layout.tp
    pipeline: dict[str, object] = {}
    analytical = full.analytical
    if layout.pp > 1:
        m = layout.microbatches or full.local_batch
        ranks, split = _pipeline_ranks(layout, full)
        rank, per_rank = _pipeline_memory(layout, full, copies, ranks, split)
        analytical = rank.analytical
        _pipeline_communication(comm, layout, full, rank, m)
        model_flops *= m / layout.pp
        times, pipeline = {}, {"bubble_s": {}, "pp_comm_s": {}, "slowest_rank": {}}
        for name in profiles:
            figures, extra = _pipeline_figures(name, layout, full, copies, ranks, split, ac_used)
            dev = device_for(name)
            figures.mfu = model_flops / figures.step_s / dev.peak_flops
            figures.reserved = int(per_rank["peak"] * dev.allocator_factor + dev.runtime_bytes)
            times[name] = figures
            for key, value in extra.items():
                pipeline[key][name] = value
        pipeline.update(rank=rank.rank, stage_blocks=[n for _, n in split], microbatches=m)
    else:
        saving = _float8_gather_saving(layout, full, kept)
        comm.wire -= (layout.shard_size - 1) / layout.shard_size * saving
        if saving:
            comm.buffers["all_gather"] -= saving
        per_rank = _memory(full, copies, _FUSED[layout.compiler], kept_bytes + _held_unsharded(layout, full))
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
        "pp": layout.pp,
        "float8": layout.float8,
    }
    if layout.pp > 1:
        assumptions["reshard_after_forward"] = layout.reshard_after_forward is True  # torchtitan's pp default
    shard_size = layout.shard_size
    return Plan(
        layout.world_size,
        full.params,
        full.layers,
        per_rank,
        analytical,
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
        pp=layout.pp,
        pp_schedule=layout.pp_schedule if layout.pp > 1 else "",
        microbatches=pipeline.get("microbatches", 1),
        stages_per_rank=layout.v if layout.pp > 1 else 1,
        pp_stage_blocks=pipeline.get("stage_blocks", []),
        pp_rank=pipeline.get("rank", 0),
        bubble_s=pipeline.get("bubble_s", {}),
        pp_comm_s=pipeline.get("pp_comm_s", {}),
        float8=layout.float8,
    )


def _col(n: float) -> str:
    return f"{size_text(n):>13}"


def format_plan(plan, seconds: float, rss: int) -> str:
    pr, an = plan.per_rank_bytes, plan.analytical_bytes
    header = f"plan: {plan.params:,} parameters, {plan.layers} blocks, world size {plan.world_size}"
    if plan.pp > 1:
        dims = [("pp", plan.pp), ("replicate", plan.replicate), ("dp", plan.shard_size), ("tp", plan.tp)]
        dims = [(name, n) for name, n in dims if n > 1 or name == "dp"]
        header += f", mesh {' x '.join(str(n) for _, n in dims)} ({' x '.join(name for name, _ in dims)})"
    elif plan.replicate > 1 and plan.tp == 1:
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
    if plan.pp > 1:
        divisor = "dp, this pp rank's stages"
    where = "rank 0, the largest shard" if plan.pp == 1 else f"pp rank {plan.pp_rank}: the highest peak"
    out = [header, "", f"per-rank memory ({where})"]
    for key in ("params", "grads", "optimizer"):
        error = (pr[key] - an[key]) / an[key] * 100 if an[key] else 0.0
        out.append(f"  {key:<14}{_col(pr[key])}   analytical numel*bytes/{divisor} {_col(an[key])}  ({error:+.3f}%)")
    if plan.pp > 1:
        out.append(f"  {'gathered_peak':<14}{_col(pr['gathered_peak'])}   its stages, gathered for the whole step")
        out.append(f"  unsharded_grads{_col(pr['unsharded_grads'])[1:]}   gradients accumulated over micro-batches")
    else:
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
    if plan.pp > 1:
        out.append(
            f"pipeline parallel {plan.pp}: {plan.pp_schedule}, {plan.microbatches} micro-batches, "
            f"{plan.stages_per_rank} stage(s) per rank, blocks per stage {plan.pp_stage_blocks} (embedding with the "
            "first, head with the last); bubble and stage sends (PP comm) below"
        )
    if plan.float8:
        out.append("float8: the blocks' Linear weights gathered in float8 (1 byte), their matmuls at the float8 peak")
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
        f"{'reserved peak':>15}"
        + (f"{'TP comm':>12}" if plan.tp_comm_s else "")
        + (f"{'bubble':>12}{'PP comm':>12}" if plan.bubble_s else "")
    )
    for name, t in plan.step_time_s.items():
        tps, mfu = plan.tokens_per_s_per_rank.get(name), plan.mfu.get(name)
        reserved = plan.peak_reserved_bytes.get(name)
        out.append(
            f"  {name:<20}{t * 1e3:>9.1f} ms{plan.exposed_comm_s[name] * 1e3:>11.1f} ms"
            + (f"{tps:>15,.0f}" if tps is not None and tps >= 100 else f"{tps:>15.3g}" if tps is not None else "")
            + (f"{mfu * 100:>6.1f}%{size_text(reserved):>15}" if mfu is not None else "")
            + (f"{plan.tp_comm_s[name] * 1e3:>9.1f} ms" if name in plan.tp_comm_s else "")
            + (
                f"{plan.bubble_s[name] * 1e3:>9.1f} ms{plan.pp_comm_s[name] * 1e3:>9.1f} ms"
                if name in plan.bubble_s
                else ""
            )
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
