"""The cost-model scheduler: choose where each all-gather starts, and keep the order with the least exposed
communication within the memory budget.

For each all-gather (in first-use order) it takes the shortest prefetch distance d <= `prefetch_depth` whose
compute window — the estimated compute from gather k-d's first use (the graph's start for k-d < 0) to its own —
covers the communication queued for it, as long as the gathered buckets alive at once fit the budget. The resulting order and the structural
order `reorder_for_overlap` left (always the longest distance) are both simulated (`cost_model.simulate`). The
cost-model order is kept unless it is estimated slower: at an equal step it holds fewer gathered buckets at once.
Decisions depend only on the graph, the config and the agreed profile.
Leaves the final timeline in `ctx.timeline`. Contract: requires "prefetched" (the structural order it compares
with), provides "ordered". Logs the distances and both estimates (logger "fsdp2_compile").
"""

from __future__ import annotations

import itertools
import logging

from torch import fx

from fsdp2_compile.compiler.cost_model import compute_time, node_time, simulate
from fsdp2_compile.compiler.overlap import anchors_at, emit_order, find_units, graph_start, memory_budget
from fsdp2_compile.compiler.pass_api import Fact, PassContext, contract
from fsdp2_compile.compiler.selective_unshard import KEPT_META
from fsdp2_compile.core.fx_edit import positions, stable_topological_sort
from fsdp2_compile.core.ir import Role

log = logging.getLogger("fsdp2_compile")


def cost_distances(gm: fx.GraphModule, gathers, depth: int, budget: int, profile) -> list[int]:
    """For gather k: the smallest d that hides its communication behind the estimated compute between gather
    k-d's first use (d = k + 1: the graph's start) and its own, at most `depth`, and only while buckets
    max(k-d, 0)..k fit in `budget`."""
    pos = positions(gm.graph)
    elapsed = list(itertools.accumulate((compute_time(n, profile) for n in gm.graph.nodes), initial=0.0))
    comm = [node_time(u.collective, profile) for u in gathers]
    start = pos[graph_start(gm)]
    distances = []
    for k, unit in enumerate(gathers):
        chosen = k
        for d in range(1, min(depth, k + 1) + 1):
            if sum(u.nbytes for u in gathers[max(k - d, 0) : k + 1]) > budget:
                break
            chosen = k - d
            window = elapsed[pos[unit.first_use]] - elapsed[pos[gathers[k - d].first_use] if d <= k else start]
            if window >= sum(comm[k - d + 1 : k + 1]):
                break
        distances.append(k - chosen)
    return distances


@contract(requires=(Fact.PREFETCHED,), provides=(Fact.ORDERED,))
def schedule(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    profile = ctx.profile
    units = find_units(gm)
    gathers = [u for u in units if u.kind == Role.ALL_GATHER]
    if ctx.config.schedule and ctx.config.prefetch and gathers:
        structural = positions(gm.graph)
        baseline = simulate(gm, profile)
        distances = cost_distances(
            gm, gathers, ctx.config.prefetch_depth, memory_budget(ctx.config, gathers, gm.meta.get(KEPT_META)), profile
        )
        emit_order(gm, units, anchors_at(gathers, distances, graph_start(gm)))
        estimate = simulate(gm, profile).total_s
        slower = estimate > baseline.total_s
        if slower:  # back to the structural order (emit_order moved the nodes in place)
            stable_topological_sort(gm, key=lambda n: (structural[n],))
        log.info(
            "%s graph: cost-model prefetch distances %s: estimated step %.3f ms vs %.3f ms structural, "
            "keeping the %s order (profile %s)",
            ctx.kind,
            distances,
            estimate * 1e3,
            baseline.total_s * 1e3,
            "structural" if slower else "cost-model",
            profile.name,
        )
    ctx.timeline = simulate(gm, profile)
    return gm
