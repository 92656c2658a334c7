"""Unit tests of bucketing, reordering and scheduling on hand-built graphs (fake process group, rank 3 of 4)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fsdp2_compile.compiler.graph_records import collectives
from fsdp2_compile.compiler.pass_list import PassContext, run_pipeline
from fsdp2_compile.config import CompileConfig
from fsdp2_compile.core.fx_edit import PARAMS
from fsdp2_compile.core.ops import REDUCE_GRAD, UNSHARD, ParamSpec
from fsdp2_compile.passes import bucket_collectives, lower_reduce_grad, lower_unshard, reorder_for_overlap, schedule

funcol = torch.ops._c10d_functional
AG, RS, WAIT = funcol.all_gather_into_tensor.default, funcol.reduce_scatter_tensor.default, funcol.wait_tensor.default
fp32, bf16 = torch.float32, torch.bfloat16
COMPUTE = {torch.ops.aten.mm.default, torch.ops.aten.relu.default}


def three_blocks(group: str, dtypes=(None, None, None)):
    """Forward of three 'blocks' (FSDP groups b0, b1, b2); b0 has two parameters, each block one matmul."""

    def f(s0a, s0b, s1, s2, x):
        def gather(shard, name, bucket, dtype):
            return UNSHARD(shard, ParamSpec(16, 4, group, dtype, fp32, name, bucket, True, 1, ""))

        h = torch.relu(x @ gather(s0a, "b0.a", "b0", dtypes[0]) @ gather(s0b, "b0.b", "b0", dtypes[1]))
        h = torch.relu(h @ gather(s1, "b1.w", "b1", dtypes[2]))
        return h @ gather(s2, "b2.w", "b2", None)

    shard = torch.randn(4, 16)
    return make_fx(f, tracing_mode="fake")(shard, shard, shard, shard, torch.randn(2, 16))


def lowered(gm, config=CompileConfig()):
    ctx = PassContext("forward", config=config)
    return bucket_collectives(lower_unshard(gm, ctx), ctx), ctx


def order(gm):
    return list(gm.graph.nodes)


def test_bucketing_fuses_one_all_gather_per_shard_call(fake_pg):
    gm, _ = lowered(three_blocks(fake_pg))
    found = collectives(gm)
    assert [c.params for c in found] == [("b0.a", "b0.b"), ("b1.w",), ("b2.w",)]
    assert [c.nbytes for c in found] == [2 * 16 * 16 * 4, 16 * 16 * 4, 16 * 16 * 4]  # exact bytes, nothing extra
    gm.graph.lint()
    assert gm(*[torch.randn(4, 16)] * 4, torch.randn(2, 16)).shape == (2, 16)


def test_bucketing_by_byte_cap_and_by_module_names(fake_pg):
    gm, _ = lowered(three_blocks(fake_pg), CompileConfig(buckets=2 * 16 * 16 * 4 // 4))  # two shards per bucket
    assert [c.params for c in collectives(gm)] == [("b0.a", "b0.b"), ("b1.w", "b2.w")]
    gm, _ = lowered(three_blocks(fake_pg), CompileConfig(buckets=("b1",)))
    assert sorted(c.params for c in collectives(gm)) == [("b0.a", "b0.b", "b2.w"), ("b1.w",)]


def test_a_bucket_with_two_dtypes_becomes_one_collective_per_dtype(fake_pg):
    gm, _ = lowered(three_blocks(fake_pg, dtypes=(bf16, None, None)))
    found = [(c.params, c.dtype) for c in collectives(gm)]
    assert (("b0.a",), bf16) in found and (("b0.b",), fp32) in found


def test_bucketed_reduce_scatter(fake_pg):
    def f(g0, g1, g2):
        return (
            REDUCE_GRAD(g0, 4, 4, fake_pg, fp32, fp32, "b0.a", "b0", 1, ""),
            REDUCE_GRAD(g1 * 2, 1, 4, fake_pg, fp32, fp32, "b0.b", "b0", 1, ""),  # 5 rows: padded to 8, rank 3 holds 1
            REDUCE_GRAD(g2, 4, 4, fake_pg, fp32, fp32, "b1.w", "b1", 1, ""),
        )

    gm = make_fx(f, tracing_mode="fake")(torch.randn(16, 3), torch.randn(5, 3), torch.randn(16, 3))
    ctx = PassContext("backward")
    gm = bucket_collectives(lower_reduce_grad(gm, ctx), ctx)
    found = collectives(gm)
    assert [c.params for c in found] == [("b0.a", "b0.b"), ("b1.w",)]
    assert found[0].nbytes == (16 + 8) * 3 * 4
    outs = [n.meta["val"].shape for n in gm.graph.output_node().args[0]]
    assert outs == [(4, 3), (1, 3), (4, 3)]


def positions_of(gm):
    nodes = order(gm)
    gathers = [n for n in nodes if n.target is AG]
    first_compute = next(i for i, n in enumerate(nodes) if n.target in COMPUTE)
    return nodes, gathers, first_compute


def test_reorder_prefetches_one_bucket_ahead_and_waits_right_before_first_use(fake_pg):
    gm, ctx = lowered(three_blocks(fake_pg))
    gm = reorder_for_overlap(gm, ctx)
    gm.graph.lint()
    nodes, gathers, first_compute = positions_of(gm)
    b0, b1, b2 = (nodes.index(g) for g in gathers)
    assert b0 < first_compute and b1 < first_compute  # b1's gather starts before b0's compute
    mm_b1 = next(
        i
        for i, n in enumerate(nodes)
        if n.target is torch.ops.aten.mm.default
        and i > b1
        and any(a.meta.get(PARAMS) == ("b1.w",) for a in n.all_input_nodes)
    )
    assert b2 < mm_b1  # b2's gather starts before b1's compute
    for wait in (n for n in nodes if n.target is WAIT):
        first_use = min(nodes.index(u) for u in wait.users)
        between = nodes[nodes.index(wait) + 1 : first_use]
        assert not any(n.target in COMPUTE for n in between)  # nothing computed between a wait and its use


def head_then_blocks(group: str):
    """A backward's shape: the head's gradient (two matmuls, no gathered parameter) comes first, then blocks b1 and
    b0 each use their gathered parameter."""

    def f(s1, s0, head, x):
        def gather(shard, name):
            return UNSHARD(shard, ParamSpec(16, 4, group, None, fp32, name, name.split(".")[0], True, 1, ""))

        h = torch.relu(x @ head @ head.T)
        h = torch.relu(h @ gather(s1, "b1.w"))
        return h @ gather(s0, "b0.w")

    shard = torch.randn(4, 16)
    return make_fx(f, tracing_mode="fake")(shard, shard, torch.randn(16, 64), torch.randn(2, 16))


@pytest.mark.parametrize("scheduled", [False, True])
def test_the_first_gathers_start_at_the_graph_start_not_after_the_compute_before_them(fake_pg, scheduled):
    """No bucket precedes a graph's first gather, so the graph's start stands for it: in a backward the first
    block's gather overlaps the head's gradient instead of starting when it is done. A budget of one bucket
    still holds: the second gather then waits for the first one's use."""
    from fsdp2_compile.core.hardware import PROFILES

    one_bucket = 16 * 16 * 4
    for config, both_early in ((CompileConfig(), True), (CompileConfig(memory_budget_bytes=one_bucket), False)):
        ctx = PassContext("backward", config=config, profile=PROFILES["cpu-gloo-1gbit"])
        gm, _ = lowered(head_then_blocks(fake_pg), config)
        gm = reorder_for_overlap(gm, ctx)
        if scheduled:
            gm = schedule(gm, ctx)
        gm.graph.lint()
        nodes, gathers, first_compute = positions_of(gm)
        assert nodes.index(gathers[0]) < first_compute
        assert (nodes.index(gathers[1]) < first_compute) is both_early


def test_a_memory_budget_keeps_gathered_only_what_the_prefetch_window_leaves():
    from fsdp2_compile.compiler.selective_unshard import keep_amount

    assert keep_amount(CompileConfig(), 100) is None  # FSDP2's behaviour
    assert keep_amount(CompileConfig(keep_gathered=0.25, memory_budget_bytes=10_000), 100) == 0.25  # explicit wins
    assert keep_amount(CompileConfig(memory_budget_bytes=1_000), 100) == 700  # window: 3 buckets of 100 bytes
    assert keep_amount(CompileConfig(memory_budget_bytes=1_000, prefetch_depth=1), 100) == 800
    assert keep_amount(CompileConfig(memory_budget_bytes=250), 100) == 0  # not even the window: nothing kept


def test_memory_budget_limits_prefetch(fake_pg):
    one_bucket = 2 * 16 * 16 * 4
    gm, ctx = lowered(three_blocks(fake_pg), CompileConfig(memory_budget_bytes=one_bucket))
    gm = reorder_for_overlap(gm, ctx)
    nodes, gathers, first_compute = positions_of(gm)
    assert nodes.index(gathers[1]) > first_compute  # b0 + b1 would exceed the budget: b1 is not prefetched


def test_reduce_scatter_waits_are_last(fake_pg):
    def f(g0, g1, x):
        a = REDUCE_GRAD(torch.relu(g0), 4, 4, fake_pg, fp32, fp32, "b1.w", "b1", 1, "")
        b = REDUCE_GRAD(torch.relu(g1), 4, 4, fake_pg, fp32, fp32, "b0.w", "b0", 1, "")
        return a, b, torch.relu(x)

    t = torch.randn(16, 3)
    gm = make_fx(f, tracing_mode="fake")(t, t, t)
    ctx = PassContext("backward")
    for p in (lower_reduce_grad, bucket_collectives, reorder_for_overlap):
        gm = p(gm, ctx)
    nodes = order(gm)
    rs = [i for i, n in enumerate(nodes) if n.target is RS]
    waits = [i for i, n in enumerate(nodes) if n.target is WAIT]
    relus = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.relu.default]
    assert rs[0] < relus[1]  # the first reduce-scatter starts before the next gradient is computed
    assert min(waits) > max(relus)  # and is waited for after all compute


def test_schedules_are_identical_for_identical_inputs_and_simulated(fake_pg):
    codes = []
    for _ in range(2):
        ctx = PassContext("forward")
        gm = run_pipeline(three_blocks(fake_pg), ctx)
        codes.append(gm.code)
        assert ctx.timeline is not None and ctx.timeline.total_s > 0
        assert ctx.timeline.comm_s > 0 and 0 <= ctx.timeline.exposed_comm_s <= ctx.timeline.comm_s
    assert codes[0] == codes[1]


def test_scheduler_never_picks_an_order_it_estimates_slower(fake_pg):
    from fsdp2_compile.compiler.cost_model import simulate
    from fsdp2_compile.core.hardware import PROFILES

    for name, profile in PROFILES.items():
        ctx = PassContext("forward", profile=profile)
        gm, _ = lowered(three_blocks(fake_pg))
        gm = reorder_for_overlap(gm, ctx)
        structural = simulate(gm, profile).total_s
        gm = schedule(gm, ctx)
        assert ctx.timeline.total_s <= structural + 1e-12, name
    plain, full = PassContext("forward", config=CompileConfig(prefetch=False)), PassContext("forward")
    run_pipeline(three_blocks(fake_pg), plain)
    run_pipeline(three_blocks(fake_pg), full)
    assert full.timeline.exposed_comm_s < plain.timeline.exposed_comm_s  # prefetching hides communication


def test_scheduler_restores_the_structural_order_when_its_own_is_estimated_slower(fake_pg, monkeypatch):
    """The cost model reorders the graph in place; when the simulation says the result is slower, the structural
    order comes back exactly (node for node) and so does its estimate."""
    import dataclasses
    import importlib

    from fsdp2_compile.compiler.cost_model import simulate
    from fsdp2_compile.core.hardware import PROFILES

    schedule_module = importlib.import_module("fsdp2_compile.passes.schedule")

    slow_compute = dataclasses.replace(PROFILES["cpu-gloo-loopback"], name="slow-compute", flops_per_s=1e6)
    ctx = PassContext("forward", profile=slow_compute)  # where the cost model's order differs (test below)
    gm, _ = lowered(three_blocks(fake_pg))
    gm = reorder_for_overlap(gm, ctx)
    structural_order = [n.name for n in order(gm)]
    estimates = iter([1.0, 2.0])  # the structural order, then the cost model's: slower

    def rigged(gm, profile):
        timeline = simulate(gm, profile)
        estimate = next(estimates, None)
        return timeline if estimate is None else dataclasses.replace(timeline, total_s=estimate)

    monkeypatch.setattr(schedule_module, "simulate", rigged)
    gm = schedule(gm, ctx)
    gm.graph.lint()
    assert [n.name for n in order(gm)] == structural_order


def test_hsdp_reduce_scatter_then_all_reduce_per_bucket_overlapping_the_next_gradient(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_compile.compiler.cost_model import collective_time
    from fsdp2_compile.core.hardware import PROFILES

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard_group, replicas = mesh.get_group("shard").group_name, mesh.get_group("replicate").group_name

    def f(g0, g1, g2, x):
        def grad(g, name, bucket):
            return REDUCE_GRAD(torch.relu(g), 8, 2, shard_group, fp32, fp32, name, bucket, 2, replicas)

        return grad(g0, "b1.a", "b1"), grad(g1, "b1.b", "b1"), grad(g2, "b0.w", "b0"), torch.relu(x)

    t = torch.randn(16, 3)
    gm = make_fx(f, tracing_mode="fake")(t, t, t, t)
    ctx = PassContext("backward")
    for p in (lower_reduce_grad, bucket_collectives, reorder_for_overlap):
        gm = p(gm, ctx)
    gm.graph.lint()
    nodes = order(gm)
    kinds = [(c.kind, c.params, c.nbytes) for c in collectives(gm)]
    # one reduce-scatter (shard group) and one all-reduce (replicas, of the reduced half) per bucket
    assert kinds == [
        ("reduce_scatter", ("b1.a", "b1.b"), 2 * 16 * 3 * 4),
        ("all_reduce", ("b1.a", "b1.b"), 2 * 8 * 3 * 4),
        ("reduce_scatter", ("b0.w",), 16 * 3 * 4),
        ("all_reduce", ("b0.w",), 8 * 3 * 4),
    ]
    [rs1, rs0] = [i for i, n in enumerate(nodes) if n.target is RS]
    ar1, _ = (i for i, n in enumerate(nodes) if n.target is funcol.all_reduce.default)
    relus = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.relu.default]
    assert rs1 < ar1 < rs0 < max(relus)  # b1's all-reduce starts before b0's reduce-scatter, while compute remains
    ar = nodes[ar1]
    assert ar.args[2] == replicas and nodes.index(ar.args[0].args[0]) == rs1  # on b1's reduced shards
    # cost: a ring all-reduce over 2 replicas moves 2 * (2-1)/2 of its bytes
    profile = PROFILES["cpu-gloo-1gbit"]
    assert collective_time(ar, profile) == profile.alpha_s + 2 * 8 * 3 * 4 * profile.beta_s_per_byte


def test_cost_model_prefetches_only_as_far_as_hides_the_gather(fake_pg):
    """Structural prefetch starts every gather `prefetch_depth` (2) buckets ahead. Where compute is slow enough that
    one bucket's compute hides a gather, the cost model starts b2's gather one bucket ahead instead: the estimated
    step is the same and b2's gathered buffer is not alive during b0's compute, so the estimated peak is lower.
    Where communication is slow (1 Gbit/s), one bucket's compute does not hide it and both orders are the same."""
    import dataclasses

    from fsdp2_compile.compiler.cost_model import simulate
    from fsdp2_compile.core.hardware import PROFILES

    slow_compute = dataclasses.replace(PROFILES["cpu-gloo-loopback"], name="slow-compute", flops_per_s=1e6)
    for profile, differs in ((slow_compute, True), (PROFILES["cpu-gloo-1gbit"], False)):
        ctx = PassContext("forward", profile=profile)
        gm, _ = lowered(three_blocks(fake_pg))
        gm = reorder_for_overlap(gm, ctx)
        structural, structural_order = simulate(gm, profile), [n.name for n in order(gm)]
        gm = schedule(gm, ctx)
        gm.graph.lint()
        nodes, gathers, first_compute = positions_of(gm)
        b2_starts_before_b0_computes = nodes.index(gathers[2]) < first_compute
        assert b2_starts_before_b0_computes is not differs, profile.name
        assert ([n.name for n in nodes] != structural_order) is differs, profile.name
        assert ctx.timeline.total_s == pytest.approx(structural.total_s, rel=1e-12)
        if differs:
            assert ctx.timeline.peak_bytes < structural.peak_bytes
