"""The passes in order: one list (`PASSES`), run by `run_pipeline` on every graph the backend (or the CLI) produces.

Each pass declares what it requires and provides (`pass_api.contract`); `run_pipeline` checks the list first.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx

from fsdp2_compile._torch_private import trace_graph_artifact
from fsdp2_compile.compiler.graph_records import NodeFacts, Snapshot, dump_requested, node_facts, snapshot
from fsdp2_compile.compiler.invariants import check_collectives_safe
from fsdp2_compile.compiler.pass_api import Pass, PassContext, check_contracts
from fsdp2_compile.passes import (
    bucket_collectives,
    combine_tied_grads,
    drop_collectives_of_one,
    keep_inputs_until_wait,
    lower_reduce_grad,
    lower_unshard,
    reduce_scatter_by_all_to_all,
    reorder_for_overlap,
    schedule,
    tag_tp_collectives,
)

__all__ = ["PASSES", "NodeFacts", "PassContext", "Snapshot", "node_facts", "run_pipeline"]

PASSES: list[Pass] = [
    tag_tp_collectives,
    drop_collectives_of_one,
    combine_tied_grads,
    lower_unshard,
    lower_reduce_grad,
    bucket_collectives,
    reorder_for_overlap,
    schedule,
    reduce_scatter_by_all_to_all,
    keep_inputs_until_wait,
]


def run_pipeline(
    gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass] | None = None, *, recompile: bool = True
) -> fx.GraphModule:
    """Run every pass of `passes` (default `PASSES`) in order, after checking their contracts; each leaves a graph
    that still lints (its code is generated once, after the last; `recompile=False`: by the caller). The result
    must pass `invariants.check_collectives_safe`. The graph after every pass is kept in `ctx.snapshots` only when
    asked for (`ctx.keep_snapshots`, `CompileConfig.keep_snapshots` or $FSDP2_COMPILE_DUMP). With `TORCH_TRACE`
    set, each pass's graph is also a structured-trace artifact (`fsdp2_<kind>_<NN>_<pass>`), so tlparse shows it
    beside Dynamo's and AOTAutograd's graphs."""
    passes = PASSES if passes is None else passes
    check_contracts(passes)
    keep = ctx.keep_snapshots or ctx.config.keep_snapshots or dump_requested()
    if keep:
        ctx.snapshots.append(snapshot("captured", gm))
    for i, p in enumerate(passes, start=1):
        gm = p(gm, ctx)
        gm.graph.lint()
        trace_graph_artifact(f"fsdp2_{ctx.kind}_{i:02d}_{p.__name__}", gm)
        if keep:
            ctx.snapshots.append(snapshot(p.__name__, gm))
    if recompile:
        gm.recompile()
    check_collectives_safe(gm)
    return gm
