"""Communication and step time of a plan: bytes on the wire per step, each bucket's collectives on a profile's link,
TP's on the intra-node link, and the step time, exposed communication, tokens/s and MFU on each device profile
(under pipeline parallelism the step is timed in `pipeline_figures.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp2_compile.core.hardware import PROFILES
from fsdp2_compile.core.ir import Role
from fsdp2_compile.planner.devices import device_for
from fsdp2_compile.planner.full_model import _FullModel
from fsdp2_compile.planner.layout import _FUSED, Layout
from fsdp2_compile.planner.model_copies import _Copies, _GraphFigures, _memo
from fsdp2_compile.planner.param_bytes import _itemsize
from fsdp2_compile.planner.step_model import StepComm, forward_backward_time, optimizer_time, phase_times
from fsdp2_compile.planner.tensor_parallel import tp_collective_s


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
