"""Reorder so communication overlaps compute (structural prefetch, no cost model).

Each all-gather starts `prefetch_depth` buckets ahead of its first use — when the compute of the bucket that many
places earlier begins (forward: block i+1's gather before block i; backward: block i-1's before block i), the
graph's start standing for the bucket before the first (so the backward's first gathers overlap the head's and
the loss's gradients instead of waiting for them) — fewer where the gathered bytes alive at once would pass the
memory budget. Every wait moves right before its first use;
reduce-scatters start as soon as their gradients exist and are waited for at the end of the graph (HSDP, or
gradients delivered inside backward: just before the next reduce-scatter starts; see `overlap.emit_order`).
Contract: requires "bucketed", provides "prefetched". Skipped when `CompileConfig.prefetch` is False. Logs the
distances (logger "fsdp2_compile").
"""

from __future__ import annotations

import logging

from torch import fx

from fsdp2_compile.compiler.overlap import anchors_at, emit_order, find_units, graph_start, memory_budget
from fsdp2_compile.compiler.pass_api import Fact, PassContext, contract
from fsdp2_compile.compiler.selective_unshard import KEPT_META
from fsdp2_compile.core.ir import Role

log = logging.getLogger("fsdp2_compile")


def prefetch_distances(gathers, depth: int, budget: int) -> list[int]:
    """For gather k (in first-use order) how many gathers earlier it starts (at gather k-d's first use; d = k + 1:
    at the graph's start): the largest d <= depth whose buckets max(k-d, 0)..k fit in `budget` (d = 0: at its own
    first use)."""
    distances = []
    for k in range(len(gathers)):
        d = min(depth, k + 1)
        while d > 0 and sum(u.nbytes for u in gathers[max(k - d, 0) : k + 1]) > budget:
            d -= 1
        distances.append(d)
    return distances


@contract(requires=(Fact.BUCKETED,), provides=(Fact.PREFETCHED,))
def reorder_for_overlap(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.config.prefetch:
        return gm
    units = find_units(gm)
    if not units:
        return gm
    gathers = [u for u in units if u.kind == Role.ALL_GATHER]
    budget = memory_budget(ctx.config, gathers, gm.meta.get(KEPT_META))
    distances = prefetch_distances(gathers, ctx.config.prefetch_depth, budget)
    log.info(
        "%s graph: structural prefetch distances %s (depth %d, budget %d bytes)",
        ctx.kind,
        distances,
        ctx.config.prefetch_depth,
        budget,
    )
    emit_order(gm, units, anchors_at(gathers, distances, graph_start(gm)))
    return gm
