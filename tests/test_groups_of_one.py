"""A process group of one rank costs nothing: a world of one, HSDP with one replica or a shard group of one, and
FSDP + TP with one data-parallel rank train bitwise as `fully_shard` does, and neither the compiled graphs nor the
uncompiled (eager) ops communicate over a group of one. The lowering on hand-built graphs, under the fake group."""

from __future__ import annotations

import functools

import pytest
import torch
from group_of_one_workers import float8_world_of_one, hsdp_meshes, world_of_one_variants
from harness import run_ranks
from module_api_workers import hsdp_accumulation, optimizer_in_backward, sum_only_reductions
from torch.fx.experimental.proxy_tensor import make_fx
from tp_workers import tp_parity

from fsdp2_compile.compiler.pass_api import PassContext
from fsdp2_compile.core.fx_edit import ROLE
from fsdp2_compile.core.ir import Role, collective_kind
from fsdp2_compile.core.ops import REDUCE_GRAD, UNSHARD, ParamSpec, divide_factors
from fsdp2_compile.passes import bucket_collectives, drop_collectives_of_one, lower_reduce_grad, lower_unshard

aten, funcol = torch.ops.aten, torch.ops._c10d_functional
bf16, fp32 = torch.bfloat16, torch.float32
SYSTEMS = ("fsdp2", "eager", "ours")


@functools.cache
def world_of_one() -> dict:
    return run_ranks(world_of_one_variants, 1)[0]


@functools.cache
def hsdp() -> dict:
    return run_ranks(hsdp_meshes, 2)[0]


def assert_bitwise_equal(r: dict, systems=SYSTEMS) -> None:
    """Every system's losses and final parameters bitwise equal to fully_shard's."""
    for system in systems:
        assert r[system] == r["fsdp2"], system
        for name, value in r["fsdp2_params"].items():
            assert torch.equal(r[f"{system}_params"][name], value), (system, name)


@pytest.mark.parametrize("variant", ["fp32", "bf16", "divide"])
def test_a_world_of_one_trains_as_fully_shard_bitwise_and_communicates_nothing(variant):
    """fp32, bf16 parameters with fp32 reduction, and a gradient divide factor of 3 (FSDP2 divides the gradient
    by it where a larger group multiplies by 1/3 before summing): compiled and eager, no collective at all."""
    r = world_of_one()[variant]
    assert_bitwise_equal(r)
    assert sorted(kind for kind, _ in r["graphs"]) == ["backward", "forward"]
    assert all(ops == [] for _, ops in r["graphs"])  # no _c10d_functional op, not even in a block's subgraph
    assert r["eager_collectives"] == {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0, "all_reduce": 0}
    if variant == "bf16":  # the casts happened: not the fp32 run
        assert r["ours"] != world_of_one()["fp32"]["ours"]


@pytest.mark.parametrize("reduce_dtype, force_sum", [(torch.float16, False), (fp32, True)])
def test_sum_only_reductions_in_a_world_of_one_divide_as_fully_shard(reduce_dtype, force_sum):
    """A divide factor of 3 with sum-only reductions: FSDP2 divides by a power of two before (fp16), by the
    factor in place of the reduce-scatter, and by the rest after; bitwise the same here."""
    r = run_ranks(sum_only_reductions, 1, reduce_dtype, force_sum, False)[0]
    assert r["ours"] == r["fsdp2"]
    for name, value in r["fsdp2_params"].items():
        assert torch.equal(r["ours_params"][name], value), name


def test_optimizer_in_backward_in_a_world_of_one_trains_as_fully_shard():
    """The hooks step each shard inside backward: the gathered parameter backward still reads is not the shard."""
    r = run_ranks(optimizer_in_backward, 1, "every_step")[0]
    assert r["ours"] == r["eager"] == r["fsdp2"]
    assert r["ours_hooks"] == r["ours_hooks_in_graph"] == r["fsdp2_hooks"] == 4 * r["hooked"]


def test_float8_in_a_world_of_one_drops_the_amax_all_reduce_and_trains_as_fully_shard():
    """torchao's float8 weights: the scale's amax all-reduce over the group of one is dropped from the graphs."""
    pytest.importorskip("torchao")
    r = run_ranks(float8_world_of_one, 1)[0]
    assert r["ours"]["losses"] == r["fsdp2"]["losses"]
    for name, value in r["fsdp2"]["params"].items():
        assert torch.equal(r["ours"]["params"][name], value), name
    assert r["graphs"] and all(ops == [] for _, ops in r["graphs"])


def test_hsdp_over_shard_groups_of_one_only_all_reduces_over_the_replicas():
    """(replicate 2, shard 1): nothing gathered, no reduce-scatter; one all-reduce over the 2 replicas per
    bucket (the two blocks and the root), as fully_shard's, bitwise."""
    r = hsdp()[(2, 1)]
    assert_bitwise_equal(r)
    graphs = dict(r["graphs"])
    assert graphs["forward"] == []
    collectives = [(op, size) for op, size, _ in graphs["backward"] if size != -1]
    assert collectives == [("all_reduce.default", 2)] * 3
    assert r["eager_collectives"]["all_gather_into_tensor"] == r["eager_collectives"]["reduce_scatter_tensor"] == 0


def test_hsdp_accumulation_over_shard_groups_of_one_matches_fully_shard_bitwise():
    """(replicate 2, shard 1), a micro-batch with set_requires_all_reduce(False), then one with it: the first
    backward communicates nothing; the second adds the kept gradients and all-reduces them a bucket at a time."""
    r = run_ranks(hsdp_accumulation, 2)[0]
    assert r["ours"] == r["fsdp2"]
    for k, p in r["fsdp2_params"].items():
        assert torch.equal(r["ours_params"][k], p), k
    assert [kinds for kind, kinds in r["graphs"] if kind == "backward"] == [[], ["all_reduce"] * 3]


def test_hsdp_with_one_replica_has_no_all_reduce():
    r = hsdp()[(1, 2)]
    assert_bitwise_equal(r)
    sizes = {size for _, ops in r["graphs"] for op, size, _ in ops if size != -1}
    assert sizes == {2} and not any(op.startswith("all_reduce") for _, ops in r["graphs"] for op, _, _ in ops)
    assert r["eager_collectives"]["all_reduce"] == 0


def test_fsdp_with_one_data_parallel_rank_and_tensor_parallelism_keeps_only_tp_collectives():
    """(dp 1, tp 2): bitwise as fully_shard with the same TP plan; the graphs hold TP's all-reduces only."""
    r = run_ranks(tp_parity, 2, "gpt")[0]
    (ours, ours_grads), (fsdp2, fsdp2_grads) = r["ours"], r["fsdp2"]
    assert ours == fsdp2
    assert all(torch.equal(ours_grads[k], g) for k, g in fsdp2_grads.items())
    assert all(found and not any(serves_params for _, serves_params in found) for _, found in r["graphs"])


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_a_gather_over_one_rank_is_the_shard_cast_and_made_contiguous(fake_pg):
    def f(shard, other):
        a = UNSHARD(shard, ParamSpec(6, 1, fake_pg, None, fp32, "a", "", True))
        b = UNSHARD(shard, ParamSpec(6, 1, fake_pg, bf16, fp32, "b", "", True))
        c = UNSHARD(other.t(), ParamSpec(3, 1, fake_pg, None, fp32, "c", "", True))
        d = UNSHARD(shard, ParamSpec(6, 1, fake_pg, None, fp32, "d", "", True, grad_key="k"))
        return a, b, c, d

    gm = lower_unshard(make_fx(f, tracing_mode="fake")(torch.randn(6, 3), torch.randn(6, 3)), PassContext("forward"))
    gm = bucket_collectives(gm, PassContext("forward"))
    a, b, c, d = gm.graph.output_node().args[0]
    assert a.op == "placeholder"  # no copy
    assert b.target is torch.ops.prims.convert_element_type.default and b.args[0] is a
    assert c.target is aten.clone.default and c.meta["val"].is_contiguous()  # the transposed shard, made dense
    assert d.target is aten.clone.default and d.args[0] is a  # delivered: the hooks step the shard in place
    assert not [n for n in _calls(gm) if collective_kind(n) is not None]


def test_a_reduction_over_one_rank_divides_as_fully_shard_and_hsdp_all_reduces_one_bucket(fake_pg):
    def f(g1, g2):
        alone = REDUCE_GRAD(g1, 6, 1, fake_pg, fp32, fp32, "a", "", 1, "", 3.0)
        x = REDUCE_GRAD(g1, 6, 1, fake_pg, fp32, fp32, "x", "", 2, fake_pg)
        y = REDUCE_GRAD(g2.t(), 3, 1, fake_pg, fp32, fp32, "y", "", 2, fake_pg)
        return alone, x, y

    ctx = PassContext("backward")
    gm = lower_reduce_grad(make_fx(f, tracing_mode="fake")(torch.randn(6, 3), torch.randn(6, 3)), ctx)
    alone = gm.graph.output_node().args[0][0]
    assert alone.target is aten.div.Tensor and alone.args[1] == 3.0  # divided by f, not multiplied by 1/f
    assert divide_factors(fp32, 1, 1, 3.0, False) == (None, None, "sum", None, 3.0)
    assert (
        divide_factors(fp32, 2, 1, 3.0, False).scale == 1 / 3 and divide_factors(fp32, 2, 1, 3.0, False).alone is None
    )
    gm = bucket_collectives(gm, ctx)
    kinds = [collective_kind(n) for n in _calls(gm) if collective_kind(n) is not None]
    assert kinds == [Role.ALL_REDUCE]  # x and y: one all-reduce over the replicas, no reduce-scatter
    [ar] = [n for n in _calls(gm) if collective_kind(n) is not None]
    assert ar.args[1] == "avg" and tuple(ar.meta["val"].shape) == (36,)
    assert ar.args[0].target is aten.cat.default and ar.args[0].meta[ROLE] == Role.COPY_IN
    _, x, y = gm.graph.output_node().args[0]
    assert tuple(x.meta["val"].shape) == (6, 3) and tuple(y.meta["val"].shape) == (3, 6)
    gm.graph.lint()


def test_collectives_over_one_rank_already_in_the_graph_are_dropped(fake_pg):
    def f(x):
        alone = funcol.wait_tensor(funcol.all_gather_into_tensor(x * 2, 1, fake_pg))
        kept = funcol.wait_tensor(funcol.all_reduce(x * 3, "sum", fake_pg))  # 4 ranks: stays
        mine = funcol.wait_tensor(funcol.all_gather_into_tensor(x, 1, fake_pg))  # a graph input: copied
        return alone, kept, mine

    gm = drop_collectives_of_one(make_fx(f, tracing_mode="fake")(torch.randn(4, 2)), PassContext("forward"))
    alone, kept, mine = gm.graph.output_node().args[0]
    assert alone.target is aten.mul.Tensor and kept.target is funcol.wait_tensor.default
    assert mine.target is aten.clone.default and mine.args[0].op == "placeholder"
    assert [collective_kind(n) for n in _calls(gm) if collective_kind(n) is not None] == [Role.ALL_REDUCE]
