"""Per-rank memory of a plan: sharded state, gathered buckets, activations and the step's peak (`_memory`; the pp
rank with the highest peak under pipeline parallelism, `_pipeline_memory`), with what selective unsharding or
`reshard_after_forward=False` keeps gathered from forward to backward.
"""

from __future__ import annotations

from fsdp2_compile.config import CompileConfig
from fsdp2_compile.planner.full_model import _FullModel
from fsdp2_compile.planner.layout import _FUSED, Layout
from fsdp2_compile.planner.model_copies import _Copies, _memo
from fsdp2_compile.planner.param_bytes import ADAMW_STATES, _itemsize
from fsdp2_compile.planner.pipeline_figures import _part_figures, _PipelineRank
from fsdp2_compile.planner.step_model import memory_peak
from fsdp2_compile.planner.trace import StepTrace


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


def _pipeline_memory(layout: Layout, full: _FullModel, copies: _Copies, ranks: list[_PipelineRank], split):
    """Per-rank bytes of the pp rank with the highest peak: its sharded state, its stages gathered for the step,
    the unsharded gradients accumulated over micro-batches (in the reduce dtype, as FSDP2 accumulates them with
    gradient sync off), the activations of the micro-batches in flight, and one micro-batch's transient."""
    from fsdp2_compile.planner.pipeline_schedule import in_flight

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
