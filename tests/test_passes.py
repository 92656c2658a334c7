"""Unit tests of each pass on small hand-built graphs, in one process with the fake process group."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fsdp2_compile.compiler.graph_records import collectives
from fsdp2_compile.compiler.pass_api import Fact, PassOrderError, check_contracts, provides, requires
from fsdp2_compile.compiler.pass_list import PASSES, PassContext, run_pipeline
from fsdp2_compile.compiler.rank_consistency import graph_groups
from fsdp2_compile.config import CompileConfig
from fsdp2_compile.core.fx_edit import PARAMS, ROLE
from fsdp2_compile.core.ir import (
    AllGatherArgs,
    CollectiveArgs,
    ReduceGradArgs,
    Role,
    Tags,
    UnshardArgs,
    collective_kind,
    nbytes,
)
from fsdp2_compile.core.ops import REDUCE_GRAD, UNSHARD, ParamSpec
from fsdp2_compile.passes import (
    bucket_collectives,
    combine_tied_grads,
    keep_inputs_until_wait,
    lower_reduce_grad,
    lower_unshard,
)

aten = torch.ops.aten
funcol = torch.ops._c10d_functional
bf16, fp32 = torch.bfloat16, torch.float32


def calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def targets(gm):
    return [n.target for n in calls(gm)]


def test_lower_unshard_casts_pads_gathers_and_unpads(fake_pg):
    # rank 3 of 4 holds the last 6 of 33 rows; every rank's shard is padded to 9 rows
    def f(shard):
        return UNSHARD(shard, ParamSpec(33, 4, fake_pg, bf16, fp32, "fc.weight", "", True, 1, "")) * 2

    gm = lower_unshard(make_fx(f, tracing_mode="fake")(torch.randn(6, 5)), PassContext("forward"))
    assert targets(gm) == [
        torch.ops.prims.convert_element_type.default,
        aten.constant_pad_nd.default,
        funcol.all_gather_into_tensor.default,
        funcol.wait_tensor.default,
        aten.slice.Tensor,
        aten.mul.Tensor,
    ]
    cast, pad, gather, wait, unpad, _ = calls(gm)
    assert gather.args[0] is pad and pad.args[0] is cast  # cast before the all-gather: bf16 on the wire
    assert gather.meta["val"].dtype == bf16 and tuple(gather.meta["val"].shape) == (36, 5)
    assert tuple(unpad.meta["val"].shape) == (33, 5)
    assert [n.meta[ROLE] for n in (cast, pad, gather, wait, unpad)] == ["cast", "pad", "all_gather", "wait", "unpad"]
    assert {n.meta[PARAMS] for n in (cast, pad, gather, wait, unpad)} == {("fc.weight",)}
    assert gm(torch.randn(6, 5)).shape == (33, 5)  # runs (the fake group returns uninitialised data)


def test_lower_unshard_without_cast_or_padding(fake_pg):
    def f(shard):
        return UNSHARD(shard, ParamSpec(32, 4, fake_pg, None, fp32, "w", "", True, 1, ""))

    gm = lower_unshard(make_fx(f, tracing_mode="fake")(torch.randn(8, 3)), PassContext("forward"))
    assert targets(gm) == [funcol.all_gather_into_tensor.default, funcol.wait_tensor.default]
    assert [c.nbytes for c in collectives(gm)] == [32 * 3 * 4]


def test_lower_unshard_gathers_a_parameter_read_twice_once(fake_pg):
    # no CSE runs on inference graphs: a tied weight (embedding and head) reaches the pass as two unshards
    def f(shard):
        return UNSHARD(shard.view(8, 3), ParamSpec(32, 4, fake_pg, None, fp32, "emb", "", True, 1, "")) + UNSHARD(
            shard.view(8, 3), ParamSpec(32, 4, fake_pg, None, fp32, "emb", "", True, 1, "")
        )

    gm = lower_unshard(make_fx(f, tracing_mode="fake")(torch.randn(8, 3)), PassContext("inference"))
    assert [c.params for c in collectives(gm)] == [("emb",)]
    assert targets(gm).count(aten.view.default) == 1  # the second read's view went with it


def test_an_offloaded_shard_is_copied_to_the_compute_device_and_its_gradient_back(fake_pg):
    """CPUOffloadPolicy on an accelerator mesh: a CPU shard goes to the compute device before anything else (the
    cast then runs there), the reduced gradient back to the shard's device last. The meta device stands in for
    the accelerator (this machine has none)."""
    device = torch.device("meta")

    def f(shard):
        full = UNSHARD(shard, ParamSpec(32, 4, fake_pg, bf16, fp32, "w", "", True, compute_device=device))
        return REDUCE_GRAD(full * 2, 8, 4, fake_pg, fp32, fp32, "w", "", 1, "", out_device=shard.device)

    gm = lower_reduce_grad(
        lower_unshard(make_fx(f, tracing_mode="fake")(torch.randn(8, 3)), PassContext("forward")),
        PassContext("backward"),
    )
    to_device = [n for n in calls(gm) if n.meta.get(ROLE) == Role.TO_DEVICE]
    assert [n.meta["val"].device.type for n in to_device] == ["meta", "cpu"]
    first, last = to_device
    assert calls(gm)[0] is first and calls(gm)[1].target is torch.ops.prims.convert_element_type.default
    assert calls(gm)[-1] is last and last.args[0].meta["val"].device.type == "meta"


def test_lower_reduce_grad_casts_pads_reduce_scatters_and_unpads(fake_pg):
    def f(grad):
        return REDUCE_GRAD(grad, 6, 4, fake_pg, fp32, fp32, "fc.weight", "", 1, "")

    gm = lower_reduce_grad(make_fx(f, tracing_mode="fake")(torch.randn(33, 5, dtype=bf16)), PassContext("backward"))
    assert targets(gm) == [
        torch.ops.prims.convert_element_type.default,
        aten.constant_pad_nd.default,
        funcol.reduce_scatter_tensor.default,
        funcol.wait_tensor.default,
        aten.slice.Tensor,
    ]
    cast, pad, rs, _wait, unpad = calls(gm)
    assert rs.args[1] == "avg" and rs.args[0].meta["val"].dtype == fp32  # reduced in reduce_dtype
    assert tuple(pad.meta["val"].shape) == (36, 5) and tuple(rs.meta["val"].shape) == (9, 5)
    assert tuple(unpad.meta["val"].shape) == (6, 5)
    [c] = collectives(gm)
    assert (c.kind, c.params, c.dtype, c.nbytes) == ("reduce_scatter", ("fc.weight",), fp32, 36 * 5 * 4)


@pytest.mark.parametrize("op", ["avg", "sum"])
def test_a_two_rank_reduce_scatter_on_gloo_becomes_an_all_to_all_and_a_local_sum(fake_pg, monkeypatch, op):
    """gloo all-reduces a reduce-scatter's whole buffer; an all-to-all moves half. The all-to-all keeps the
    reduce-scatter's tags and counts as one; the two halves are added (and halved for "avg") after the wait."""
    import sys

    module = sys.modules["fsdp2_compile.passes.reduce_scatter_by_all_to_all"]
    monkeypatch.setattr(module, "_on_gloo", lambda group_name: True)  # the fake group stands in for gloo

    def f(grad):
        return REDUCE_GRAD(grad, 3, 2, fake_pg, fp32, fp32, "w", "", 1, "", 0.0 if op == "avg" else 2.0) + 1

    ctx = PassContext("backward")
    gm = lower_reduce_grad(make_fx(f, tracing_mode="fake")(torch.randn(6, 5)), ctx)
    before = collectives(gm)
    gm = module.reduce_scatter_by_all_to_all(gm, ctx)
    assert collectives(gm) == before  # the same reduce-scatter, counted alike
    expected = [
        funcol.all_to_all_single.default,
        funcol.wait_tensor.default,
        aten.slice.Tensor,
        aten.slice.Tensor,
        aten.add.Tensor,
    ] + ([aten.div.Tensor] if op == "avg" else [])
    assert targets(gm)[-len(expected) - 1 : -1] == expected
    a2a = next(n for n in calls(gm) if n.target is funcol.all_to_all_single.default)
    assert a2a.args[1:3] == ([3, 3], [3, 3]) and a2a.meta[ROLE] == Role.REDUCE_SCATTER
    assert tuple(calls(gm)[-1].meta["val"].shape) == (3, 5)


def test_lower_reduce_grad_makes_a_transposed_gradient_contiguous(fake_pg):
    def f(g):
        return REDUCE_GRAD(g.t(), 2, 4, fake_pg, fp32, fp32, "w", "", 1, "")

    gm = lower_reduce_grad(make_fx(f, tracing_mode="fake")(torch.randn(5, 8)), PassContext("backward"))
    rs = next(n for n in calls(gm) if n.target is funcol.reduce_scatter_tensor.default)
    assert rs.args[0].target is aten.clone.default and rs.args[0].meta["val"].is_contiguous()


def test_combine_tied_grads_reduces_the_sum_once(fake_pg):
    def f(a, b, c):
        tied = REDUCE_GRAD(a, 3, 4, fake_pg, fp32, fp32, "emb.weight", "", 1, "").view(3, 4) + REDUCE_GRAD(
            b, 3, 4, fake_pg, fp32, fp32, "emb.weight", "", 1, ""
        )
        other = REDUCE_GRAD(c, 3, 4, fake_pg, fp32, fp32, "other", "", 1, "")
        return tied, other

    x = torch.randn(10, 4)
    gm = combine_tied_grads(make_fx(f, tracing_mode="fake")(x, x, x), PassContext("backward"))
    reductions = [n for n in calls(gm) if n.target is REDUCE_GRAD]
    assert [n.args[6] for n in reductions] == ["emb.weight", "other"]
    assert reductions[0].args[0].target is aten.add.Tensor


def test_combine_tied_grads_leaves_different_parameters_alone(fake_pg):
    def f(a, b):
        return REDUCE_GRAD(a, 3, 4, fake_pg, fp32, fp32, "x", "", 1, "") + REDUCE_GRAD(
            b, 3, 4, fake_pg, fp32, fp32, "y", "", 1, ""
        )

    x = torch.randn(10, 4)
    gm = combine_tied_grads(make_fx(f, tracing_mode="fake")(x, x), PassContext("backward"))
    assert targets(gm).count(REDUCE_GRAD) == 2


def test_pipeline_leaves_a_graph_without_fsdp_ops_unchanged(fake_pg):
    gm = make_fx(lambda x: (x * 2).sum(), tracing_mode="fake")(torch.randn(3))
    before = str(gm.graph)
    ctx = PassContext("forward", keep_snapshots=True)
    assert str(run_pipeline(gm, ctx).graph) == before
    assert [s.name for s in ctx.snapshots] == ["captured"] + [p.__name__ for p in PASSES]


def test_snapshots_only_when_asked_for(fake_pg, monkeypatch):
    monkeypatch.delenv("FSDP2_COMPILE_DUMP", raising=False)
    gm = make_fx(lambda x: (x * 2).sum(), tracing_mode="fake")(torch.randn(3))
    ctx = PassContext("forward")
    run_pipeline(gm, ctx)
    assert ctx.snapshots == []
    ctx = PassContext("forward", config=CompileConfig(keep_snapshots=True))
    run_pipeline(gm, ctx)
    assert len(ctx.snapshots) == len(PASSES) + 1


def test_each_pass_graph_is_a_structured_trace_artifact(fake_pg):
    """What `TORCH_TRACE=dir` records (tlparse shows it beside Dynamo's and AOTAutograd's graphs): one artifact per
    pass, named by graph kind, position and pass, holding that pass's graph."""
    import logging

    from torch._logging._internal import trace_log

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.records = []

        def emit(self, record):
            self.records.append(record)

    def f(shard):
        return UNSHARD(shard, ParamSpec(32, 4, fake_pg, None, fp32, "w", "", True, 1, "")) * 2

    handler = Collect()
    trace_log.addHandler(handler)
    try:
        run_pipeline(make_fx(f, tracing_mode="fake")(torch.randn(8, 3)), PassContext("forward"))
    finally:
        trace_log.removeHandler(handler)
    artifacts = {
        r.metadata["artifact"]["name"]: r.payload for r in handler.records if "artifact" in getattr(r, "metadata", {})
    }
    assert list(artifacts) == [f"fsdp2_forward_{i:02d}_{p.__name__}" for i, p in enumerate(PASSES, start=1)]
    name = {p.__name__: f"fsdp2_forward_{i:02d}_{p.__name__}" for i, p in enumerate(PASSES, start=1)}
    assert "all_gather_into_tensor" in artifacts[name["lower_unshard"]]
    assert "all_gather_into_tensor" not in artifacts[name["combine_tied_grads"]]


def test_every_pass_declares_a_contract_that_the_default_order_meets():
    check_contracts(PASSES)
    assert all(requires(p) or provides(p) for p in PASSES)
    assert Fact.COLLECTIVES_SAFE in provides(PASSES[-1])


def test_a_misordered_pass_list_is_refused_with_a_clear_message(fake_pg):
    """Bucketing before lowering (and a pipeline that reorders after choosing the final order) are refused before
    any pass runs, naming the pass, what it lacks and which pass provides it."""
    misordered = [combine_tied_grads, bucket_collectives, lower_unshard, lower_reduce_grad]
    with pytest.raises(
        PassOrderError,
        match=r"pass #1 bucket_collectives requires 'reduce_grad_lowered', "
        r"'unshard_lowered'.*'unshard_lowered' is provided by lower_unshard",
    ):
        check_contracts(misordered)
    gm = make_fx(lambda x: (x * 2).sum(), tracing_mode="fake")(torch.randn(3))
    before = str(gm.graph)
    with pytest.raises(PassOrderError, match="keep_inputs_until_wait requires 'ordered'"):
        run_pipeline(gm, PassContext("forward"), [keep_inputs_until_wait, *PASSES])
    assert str(gm.graph) == before  # nothing ran
    run_pipeline(gm, PassContext("forward"), [*PASSES, lambda gm, ctx: gm])  # a pass without a contract is fine


def test_views_name_every_schema_argument(fake_pg):
    def f(shard):
        return UNSHARD(shard, ParamSpec(33, 4, fake_pg, bf16, fp32, "fc.weight", "blocks.0", True))

    gm = make_fx(f, tracing_mode="fake")(torch.randn(6, 5))
    [node] = [n for n in calls(gm) if n.target is UNSHARD]
    a = UnshardArgs.of(node)
    assert [f.name for f in dataclasses.fields(a)] == [arg.name for arg in UNSHARD._schema.arguments]
    assert (a.fqn, a.bucket, a.dim0, a.reshard_after_forward) == ("fc.weight", "blocks.0", 33, True)
    assert (a.replicate_size, a.pending_key) == (1, "")  # the spec's defaults
    assert a.static() == a.as_args()[1:-2] and a.replace(fqn="x").fqn == "x"  # tensors: shard, gathered, grad_anchor
    with pytest.raises(TypeError, match="not"):
        ReduceGradArgs.of(node)
    gm = lower_unshard(gm, PassContext("forward"))
    [gather] = [n for n in calls(gm) if collective_kind(n) == Role.ALL_GATHER]
    c = CollectiveArgs.of(gather)
    assert isinstance(c, AllGatherArgs) and (c.group_size, c.group_name, c.ranks()) == (4, fake_pg, 4)
    assert Tags.of(gather) == Tags(("fc.weight",), "blocks.0", Role.ALL_GATHER)
    assert nbytes(gather.meta["val"]) == 36 * 5 * 2  # 4 ranks x 9 padded rows, bf16


def test_unshard_spec_is_a_constant_guarded_by_equality(fake_pg):
    """Dynamo bakes an unshard's `ParamSpec` into the graph: an equal spec reuses the compiled graph, another one
    recompiles, and the graph's code rebuilds the spec."""
    holder = SimpleNamespace(spec=ParamSpec(8, 4, fake_pg, bf16, fp32, "w", "", True))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    f = torch.compile(lambda shard: UNSHARD(shard, holder.spec), backend=backend, fullgraph=True)
    shard = torch.randn(2, 3)
    f(shard)
    holder.spec = ParamSpec(8, 4, fake_pg, bf16, fp32, "w", "", True)  # equal, another object
    f(shard)
    assert len(graphs) == 1
    holder.spec = dataclasses.replace(holder.spec, fqn="v")
    assert f(shard).shape == (8, 3) and len(graphs) == 2
    [node] = [n for n in calls(graphs[1]) if n.target is UNSHARD]
    assert UnshardArgs.of(node).spec == holder.spec and UnshardArgs.of(node).fqn == "v"
    assert "ParamSpec(dim0=8" in graphs[1].code
    assert graph_groups(graphs[1]) == {fake_pg}  # the rank-consistency check finds the group inside the spec
    text, names = holder.spec.__fx_repr__()
    assert eval(text, {"torch": torch, **names}) == holder.spec


def test_inserted_nodes_get_the_fake_values_the_fake_mode_would_give():
    """`fx_edit.insert_call` makes the fake outputs of collectives, copy-in / copy-out views, casts, pads, scalings and
    `fsdp2::reduce_grad` on the meta kernels
    (`_META_OUTPUTS`): the same shape, strides, offset, dtype, device and mode as the op run under the fake mode,
    a view sharing its input's fake storage, anything else a fresh one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp2_compile._torch_private import fake_output_by_meta_kernel
    from fsdp2_compile.core.fx_edit import _META_OUTPUTS

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    mode = FakeTensorMode()
    with mode:
        table, a, b = (
            torch.empty(2, 96),
            torch.empty(3, 8, dtype=torch.bfloat16),
            torch.empty(5, 8, dtype=torch.bfloat16),
        )
        cols = table[:, 16:48]
    calls = [
        (aten.view.default, (a, [-1]), {}),
        (aten.slice.Tensor, (table, 1, 16, 48), {}),
        (aten.clone.default, (cols,), {"memory_format": torch.contiguous_format}),
        (aten.view.default, (table, [4, 48]), {}),
        (aten.cat.default, ([a.view(-1), b.view(-1)],), {}),
        (c10d.all_gather_into_tensor.default, (a, 4, "g"), {}),
        (c10d.reduce_scatter_tensor.default, (b.view(-1), "avg", 2, "g"), {}),
        (c10d.wait_tensor.default, (a,), {}),
        (torch.ops.prims.convert_element_type.default, (a, torch.float32), {}),
        (aten.constant_pad_nd.default, (b, [0, 0, 0, 3]), {}),
        (aten.mul.Tensor, (a, 0.5), {}),
        (aten.div.Tensor, (cols, 3.0), {}),
        (torch.ops.fsdp2.reduce_grad.default, (b, 3, 2, "g", torch.float32, torch.bfloat16, "w", "", 1, ""), {}),
    ]
    assert {op for op, _, _ in calls} == set(_META_OUTPUTS)
    for op, args, kwargs in calls:
        fast = fake_output_by_meta_kernel(_META_OUTPUTS[op], args, kwargs)
        with mode:
            slow = op(*args, **kwargs)
        describe = lambda t: (type(t), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.fake_mode)  # noqa: E731
        assert describe(fast) == describe(slow), op
        first = args[0] if isinstance(args[0], torch.Tensor) else None
        shares = first is not None and fast.untyped_storage()._cdata == first.untyped_storage()._cdata
        assert shares == (op in (aten.view.default, aten.slice.Tensor)), op
    offloaded = (b, 3, 2, "g", torch.float32, torch.bfloat16, "w", "", 1, "")
    assert (
        fake_output_by_meta_kernel(
            _META_OUTPUTS[torch.ops.fsdp2.reduce_grad.default], offloaded, {"out_device": torch.device("meta")}
        )
        is None
    )  # a device named: the op's own fake
    with FakeTensorMode():
        other = torch.empty(4)
    assert fake_output_by_meta_kernel(aten.cat.default, ([a.view(-1), other],), {}) is None  # two modes' tensors
