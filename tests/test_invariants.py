"""The executable-graph invariant: a collective's inputs outlive its wait, and only the wait reads its result.
Hand-built graphs in one process with the fake process group."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fsdp2_compile.compiler.invariants import UnsafeGraphError, check_collectives_safe
from fsdp2_compile.compiler.pass_list import PassContext, run_pipeline
from fsdp2_compile.config import CompileConfig
from fsdp2_compile.core.ops import KEEP_ALIVE, REDUCE_GRAD, UNSHARD, ParamSpec
from fsdp2_compile.passes import keep_inputs_until_wait

funcol = torch.ops._c10d_functional
fp32 = torch.float32


def reduce_then_compute(group: str):
    """A reduce-scatter whose input (a fresh buffer) is last used by the collective; compute runs before its wait:
    the order the scheduler emits to overlap a reduce-scatter with the rest of the backward."""

    def f(grad, x):
        buf = grad * 2
        started = funcol.reduce_scatter_tensor.default(buf, "avg", 4, group)
        y = torch.relu(x @ x)
        return funcol.wait_tensor.default(started) + 1, y

    return make_fx(f, tracing_mode="fake")(torch.randn(8, 4), torch.randn(4, 4))


def freed_before_wait(gm) -> bool:
    """Whether the generated code sets the collective's input to None before the line that waits for it."""
    lines = gm.code.splitlines()
    wait_line = next(i for i, line in enumerate(lines) if "wait_tensor" in line)
    return any("mul = None" in line or "mul_tensor = None" in line for line in lines[:wait_line])


def test_an_input_freed_before_its_wait_is_refused(fake_pg):
    gm = reduce_then_compute(fake_pg)
    assert freed_before_wait(gm)  # the hazard: fx frees `buf` right after starting the collective
    with pytest.raises(
        UnsafeGraphError, match=r"input mul\w* of collective reduce_scatter_tensor\w* is last used before its wait"
    ):
        check_collectives_safe(gm)


def test_keep_inputs_until_wait_makes_the_graph_safe(fake_pg):
    gm = keep_inputs_until_wait(reduce_then_compute(fake_pg), PassContext("backward"))
    gm.recompile()
    check_collectives_safe(gm)
    [keep] = [n for n in gm.graph.nodes if n.target is KEEP_ALIVE]
    wait = next(n for n in gm.graph.nodes if n.target is funcol.wait_tensor.default)
    assert keep.args[0][0] is wait and keep.args[0][1].name.startswith("mul")  # after the wait, holding the input
    assert not freed_before_wait(gm)
    gm.graph.eliminate_dead_code()  # a side-effect op: DCE (Inductor runs one) must not drop it
    assert any(n.target is KEEP_ALIVE for n in gm.graph.nodes)
    gm(torch.randn(8, 4), torch.randn(4, 4))  # runs


def test_a_result_read_before_its_wait_is_refused(fake_pg):
    def f(x):
        started = funcol.all_gather_into_tensor.default(x, 4, fake_pg)
        early = started.sum()  # reads the buffer the collective is still writing
        return funcol.wait_tensor.default(started), early

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 3))
    with pytest.raises(UnsafeGraphError, match="exactly one wait_tensor and no other user"):
        check_collectives_safe(gm)


def test_a_read_of_the_result_size_before_its_wait_is_safe(fake_pg):
    """A dynamic shape makes the graph read a variable-split all-to-all's output size (metadata, not data) before
    its wait, e.g. to save it for backward: allowed."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    started = graph.call_function(funcol.all_to_all_single.default, (x, [3, 5], [4, 4], fake_pg))
    size = graph.call_function(torch.ops.aten.sym_size.int, (started, 0))
    done = graph.call_function(funcol.wait_tensor.default, (started,))
    graph.output((done, size))
    check_collectives_safe(torch.fx.GraphModule(torch.nn.Module(), graph))


@pytest.mark.parametrize(
    "config",
    [CompileConfig(), CompileConfig(buckets="none"), CompileConfig(prefetch_depth=3), CompileConfig(schedule=False)],
    ids=["default", "unbucketed", "deep-prefetch", "structural"],
)
def test_every_pipeline_output_is_safe(fake_pg, config):
    """Forward and backward of three blocks through the whole pipeline: every collective input is used at or
    after its wait (run_pipeline checks it too; this asserts it independently of that call)."""

    def f(s0, s1, s2, x):
        def gather(shard, i):
            return UNSHARD(shard, ParamSpec(16, 4, fake_pg, None, fp32, f"b{i}.w", f"b{i}", True, 1, ""))

        h = x
        for i, s in enumerate((s0, s1, s2)):
            h = torch.relu(h @ gather(s, i))
        grads = [
            REDUCE_GRAD(h.t() @ h * (i + 1), 4, 4, fake_pg, fp32, fp32, f"b{i}.w", f"b{i}", 1, "") for i in range(3)
        ]
        return h, grads

    shard = torch.randn(4, 16)
    gm = run_pipeline(
        make_fx(f, tracing_mode="fake")(shard, shard, shard, torch.randn(2, 16)), PassContext("backward", config=config)
    )
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    collectives = [
        n
        for n in gm.graph.nodes
        if n.target in (funcol.all_gather_into_tensor.default, funcol.reduce_scatter_tensor.default)
    ]
    assert len(collectives) == 6  # one all-gather and one reduce-scatter per block
    for c in collectives:
        [wait] = c.users
        for inp in c.all_input_nodes:
            assert max(order[u] for u in inp.users) > order[wait], (c.name, inp.name)
