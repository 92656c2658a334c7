"""Pipeline-parallel figures of a plan: each pp rank's stages, parameters and buckets, its collectives per step, and
the step time on a profile (the slowest rank's micro-batches, the bubble, the stage sends), with the schedule
model of `pipeline_schedule.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp2_compile.core.hardware import PROFILES
from fsdp2_compile.planner.devices import device_for
from fsdp2_compile.planner.full_model import _FullModel
from fsdp2_compile.planner.layout import _FUSED, Layout
from fsdp2_compile.planner.model_copies import _Copies, _memo
from fsdp2_compile.planner.param_bytes import _itemsize
from fsdp2_compile.planner.step_model import optimizer_time
from fsdp2_compile.planner.step_time import _collective_s, _Communication, _ProfileFigures, _tp_phase_seconds


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
    """Each pp rank's parameters and buckets under torchtitan's split (`pipeline_schedule.stage_blocks`)."""
    from fsdp2_compile.planner.pipeline_schedule import rank_stages, stage_blocks

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
    from fsdp2_compile.planner.pipeline_schedule import bubble_s, pp_comm_s
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
