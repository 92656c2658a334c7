"""The planner: per-rank memory, bytes on the wire, step time, tokens/s and MFU of a model sharded over N ranks,
without the memory or the ranks (the model on the meta device, one process, the fake process group).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fsdp2_compile.core.hardware import PROFILES
from fsdp2_compile.planner.devices import device_for
from fsdp2_compile.planner.full_model import _FullModel, _shard_full_model
from fsdp2_compile.planner.layout import _FUSED, Layout
from fsdp2_compile.planner.memory import _held_unsharded, _kept_decision, _kept_for_backward, _memory, _pipeline_memory
from fsdp2_compile.planner.model_copies import _compile_and_trace_copies, _Copies
from fsdp2_compile.planner.pipeline_figures import _pipeline_communication, _pipeline_figures, _pipeline_ranks
from fsdp2_compile.planner.step_time import _communication, _float8_gather_saving, _profile_figures
from fsdp2_compile.planner.tensor_parallel import plan_meshes

__all__ = ["Plan", "make_plan"]


# Method:
# - parameters, gradients, optimizer state: the REAL `shard` of the full model at world size N (rank 0, which holds
#   the largest shard, ceil(dim0 / S) rows, S = N the shard size; HSDP with R replicas: S = N / R, mesh R x S);
#   gradients are sharded like the parameters, in their dtype; AdamW keeps two fp32 states per element of the shard.
#   Compared with the analytical numel x bytes / S.
# - reduced copies (`reduced_depth.py`): the factory's `layers=` 1 and 2, or else the model's block list cut to 1 and 2
#   blocks; per-block figures (2 blocks minus 1) are scaled to the full block count.
# - collectives: the real pipeline compiles each copy and the final graphs' collectives give the bytes sent. A ring
#   over a collective's group of G ranks sends (G-1)/G of an all-gather's or reduce-scatter's full buffer and
#   2(G-1)/G of an all-reduce's (HSDP: G = R for the all-reduces). Timed on the profile's link, a reduce-scatter
#   times the device's `reduce_scatter_factor` (gloo's takes as long as an all-reduce: 2, measured) unless its group
#   has two ranks (the pipeline then runs it as an all-to-all: 1).
# - activations and compute: one step of each copy played op by op on the meta device (`trace.py`), with the
#   attention (`attention.py`) and activation checkpointing (`activation_checkpointing.py`) asked for; time, schedule and the
#   allocator's peak from `step_model.py`, device figures from `devices.py`.
# - tensor parallelism (`tp` > 1, `tensor_parallel.py`): the mesh is (dp, tp) (or (replicate, shard, tp)), the TP plan is
#   applied to every block with `parallelize_module` before `shard` over dp, so the per-rank bytes are the real
#   (dp, tp)-local shards; TP's collectives (Role.TP in the compiled graphs) are counted apart from FSDP's, per layer
#   (2 blocks minus 1), and timed on the profile's intra-node link, on the critical path (nothing overlaps them);
#   compute and activations are traced on a TP-local copy (column-wise Linears with out / tp features, row-wise with
#   in / tp); MFU counts the unsplit model's FLOPs / tp per rank, tokens/s per rank the dp rank's tokens / tp
#   (torchtitan's per-GPU figures).
# - pipeline parallelism (`pp` > 1, `pipeline_schedule.py`, `pipeline_figures.py`): the mesh is (pp, [replicate,] dp
#   [, tp]); the copies are compiled and played for one micro-batch, their figures split into a block's, the
#   embedding's (first stage) and the head's (last stage) by where each op ran (`OpRecord.part`); each pp rank's
#   memory from its stages' parameters of the full model's shard, the figures shown are the rank with the highest
#   peak; FSDP's collectives per step from its buckets (one gather and one reduction: torch's schedules keep a stage
#   gathered until its last micro-batch).
# - float8 (`float8`): gathered bytes of the blocks' Linear weights at 1 byte, their matmuls at the float8 peak
#   (`step_model.op_seconds`); the graphs' all-gather bytes less the difference.
#
# Here: `Plan`, and `make_plan` / `_assemble`, which put it together from the sharded full model (`full_model.py`,
# `param_bytes.py`), the copies' graphs and traces (`model_copies.py`), and the figures of `memory.py`,
# `step_time.py` and `pipeline_figures.py`; `layout.py` holds what a plan is made for, `format.py` prints one.
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
