"""Identical blocks traced once, their parameters gathered outside them."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from fsdp2_compile._torch_private import op_schema
from fsdp2_compile.core.grouped_unshard import gather_group, group_key
from fsdp2_compile.core.ir import UNSHARD, SubgraphCall, UnshardArgs, output_of
from fsdp2_compile.runtime.param_state import ParamInfo, infos_of_values

__all__ = ["gather_again_in_backward", "gather_outside_blocks", "saved_inputs_from_callers"]

PARTITIONED_FW, PARTITIONED_BW = "partitioned_fw", "partitioned_bw"
"""How AOTAutograd (torch 2.13) names the halves of a partitioned subgraph in the joint graph's calls."""


# ---------------------------------------------------------------------------------------------- before AOTAutograd


# `shard` marks the outermost blocks sharded before the root (`sharding._trace_blocks_once`): their class's forward
# becomes a nested compile region (`torch.compiler.nested_compile_region`), so Dynamo traces one block and stamps
# out the others as `invoke_subgraph` calls of the same subgraph, and AOTAutograd traces and partitions that
# subgraph once. For Dynamo's guards to hold for every block, a block's `module.weight` leaves out what names the
# parameter (`ParamInfo.spec(anonymous=True)`). Two rewrites keep FSDP's semantics:
#
# - `gather_outside_blocks` (before AOTAutograd): every `fsdp2::unshard` of a block's subgraph (or of an activation
#   checkpoint inside it) moves to the calling graph, before the call, named again from the parameter the call
#   passes. The subgraph computes on gathered parameters; the passes see, bucket, prefetch and schedule every
#   block's collectives as before. A call's trained parameters that are neither kept nor delivered their gradient
#   are gathered by one `GatherGroup` autograd node calling one `fsdp2::unshard_group` (`grouped_unshard.py`), so
#   AOTAutograd traces one op per call.
# - `gather_again_in_backward` (before the partitioner): what the block's forward subgraph saves for its backward
#   that it computed from gathered parameters alone is computed in the backward subgraph instead, from the
#   parameter passed in, so that the partitioner gathers it again (resharding after forward) instead of saving it.
# - `saved_inputs_from_callers` (before the partitioner): what the block's forward saves that is one of its inputs
#   (or a view of one) is read from the calling graph, not from the call's outputs, which Inductor takes to alias
#   nothing.
#
# Blocks that differ (other shapes, other settings) get a subgraph each; Dynamo inlines one called once.
def gather_outside_blocks(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Move the `fsdp2::unshard` calls of `gm`'s block subgraphs into `gm`, before each call, with the names of the
    parameter it passes; name the anonymous `fsdp2::unshard` calls of `gm` itself."""
    calls = [c for c in map(SubgraphCall.of, gm.graph.nodes) if c is not None and c.identifier]
    info_of = _infos_by_input(gm, example_inputs)
    moved: dict[int, dict[int, tuple[int | None, int | None]]] = {}
    for call in calls:
        body = call.module()
        if id(body) not in moved:
            moved[id(body)] = _take_unshards_out(body)
        operands = list(call.operands)
        plain: dict[int, tuple[fx.Node, ParamInfo]] = {}  # trained, neither kept nor delivered: one `GatherGroup`
        for index, tensors in moved[id(body)].items():
            gathered, anchor = (None if i is None else operands[i] for i in tensors)
            info = info_of.get(operands[index])
            if info is None:
                raise RuntimeError(
                    f"fsdp2_compile: cannot tell which parameter {call.node.format_node()} passes at {index}"
                )
            if gathered is None and anchor is None and _requires_grad(operands[index]):
                plain[index] = operands[index], info
                continue
            with gm.graph.inserting_before(call.node):
                shard = gm.graph.call_method("to_local", (operands[index],))
                operands[index] = gm.graph.call_function(UNSHARD, (shard, info.spec(), gathered, anchor))
        if plain:
            with gm.graph.inserting_before(call.node):
                key = group_key([info.spec() for _, info in plain.values()])
                group = gm.graph.call_function(gather_group, (key, *(param for param, _ in plain.values())))
                for i, index in enumerate(plain):
                    operands[index] = gm.graph.call_function(operator.getitem, (group, i))
        call.set_operands(operands)
    _name_in_place(gm, info_of.get)
    gm.graph.lint()
    gm.recompile()


def _requires_grad(node: fx.Node) -> bool:
    """Whether the parameter `node` requires a gradient (a frozen one is gathered alone: a group's backward would
    reduce a gradient for every parameter of it)."""
    return bool(getattr(node.meta.get("example_value"), "requires_grad", False))


def _name_in_place(gm: fx.GraphModule, info_of: Callable[[fx.Node], ParamInfo | None]) -> None:
    """Name the anonymous `fsdp2::unshard` calls left in `gm` and in the activation checkpoints it calls (a block
    Dynamo inlined because it was called once)."""
    for node in list(gm.graph.nodes):
        nested = SubgraphCall.of(node)
        if nested is not None and not nested.identifier:
            body = nested.module()
            outer = dict(zip(body.graph.find_nodes(op="placeholder"), nested.operands))
            _name_in_place(body, lambda p, outer=outer: info_of(outer.get(p)))
        elif node.op == "call_function" and node.target is UNSHARD and not UnshardArgs.of(node).fqn:
            call = UnshardArgs.of(node)
            info = info_of(_param_of(call.shard))
            if info is None:
                raise RuntimeError(f"fsdp2_compile: cannot tell which parameter {node.format_node()} gathers")
            node.args = call.replace(spec=info.spec()).as_args()
    gm.recompile()


def _take_unshards_out(
    body: fx.GraphModule, done: dict[int, dict] | None = None
) -> dict[int, tuple[int | None, int | None]]:
    """Rewrite `body` (and the subgraphs it calls) to take gathered parameters where it took shards: each
    `to_local` -> `fsdp2::unshard` of a placeholder becomes that placeholder. Returns {index of such a placeholder:
    the indices of the placeholders its unshard took as `gathered` (a kept parameter) and as `grad_anchor`, or
    None}."""
    done = {} if done is None else done
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    index = {p: i for i, p in enumerate(placeholders)}
    moved: dict[int, tuple[int | None, int | None]] = {}

    def outer(node: Any, user: fx.Node) -> int:
        if node not in index:
            raise RuntimeError(
                f"fsdp2_compile: a block traced once reads a parameter in a way that cannot be gathered outside it "
                f"({user.format_node()}); please report it with the block's code"
            )
        return index[node]

    for node in list(body.graph.nodes):
        nested = SubgraphCall.of(node)
        if nested is not None:  # activation checkpointing inside the block
            inner = nested.module()
            if id(inner) not in done:
                done[id(inner)] = _take_unshards_out(inner, done)
            for j, tensors in done[id(inner)].items():
                tensors = tuple(None if i is None else outer(nested.operands[i], node) for i in tensors)
                moved.setdefault(outer(nested.operands[j], node), tensors)
        elif node.op == "call_function" and node.target is UNSHARD:
            call = UnshardArgs.of(node)
            param = _param_of(call.shard)
            moved.setdefault(
                outer(param, node),
                tuple(None if t is None else outer(t, node) for t in (call.gathered, call.grad_anchor)),
            )
            param.meta["example_value"] = node.meta.get("example_value")
            node.replace_all_uses_with(param)
            body.graph.erase_node(node)
            if not call.shard.users:
                body.graph.erase_node(call.shard)
    for i in moved:
        if any(_param_of(user) is not None for user in placeholders[i].users):
            raise RuntimeError(f"fsdp2_compile: a block traced once reads the shard of {placeholders[i].name} itself")
    body.graph.lint()
    body.recompile()
    return moved


def _param_of(shard: Any) -> fx.Node | None:
    """The DTensor parameter whose local shard `shard` is (Dynamo's `param.to_local()`), else None."""
    if not (isinstance(shard, fx.Node) and shard.op == "call_method" and shard.target == "to_local"):
        return None
    (param,) = shard.args
    return param


def _infos_by_input(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[fx.Node, ParamInfo]:
    """The `ParamInfo` of each placeholder of `gm` that is a parameter `shard` manages."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    return {node: info for node, info in zip(placeholders, infos_of_values(example_inputs)) if info is not None}


# ---------------------------------------------------------------------------------------------- before partitioning


def gather_again_in_backward(joint: fx.GraphModule) -> None:
    """After AOTAutograd partitioned a block's subgraph (once for all its calls): what the block's forward saves
    for its backward that is computed from gathered parameters alone (the parameter itself, its transpose, ...) is
    computed in the backward subgraph instead, from the gathered parameter passed to it. The backward call then
    takes the joint graph's `fsdp2::unshard`, which the partitioner recomputes in backward like any other
    (resharding after forward) instead of saving a gathered parameter from forward to backward."""
    plans: dict[int, tuple[list[int], list[int]]] = {}
    for bw in [c for c in map(SubgraphCall.of, joint.graph.nodes) if c is not None]:
        if not bw.identifier.startswith(PARTITIONED_BW):
            continue
        fw_identifier = PARTITIONED_FW + bw.identifier.removeprefix(PARTITIONED_BW)
        saved_from = {src for src, _ in _outputs_read(bw) if SubgraphCall.of(src).identifier == fw_identifier}
        if len(saved_from) != 1:
            continue
        fw = SubgraphCall.of(saved_from.pop())
        params = {k for k, a in enumerate(fw.operands) if isinstance(a, fx.Node) and a.target is UNSHARD}
        plan = _plan(fw, bw, params)
        body = bw.module()
        if id(body) not in plans:
            plans[id(body)] = plan
            _recompute(fw, bw, plan)
        elif plans[id(body)] != plan:
            raise RuntimeError(
                f"fsdp2_compile: calls of block subgraph {bw.identifier} differ in which inputs are parameters"
            )
        dropped, added = plan
        bw.set_operands([a for i, a in enumerate(bw.operands) if i not in dropped] + [fw.operands[k] for k in added])
    joint.graph.lint()
    joint.recompile()


def _outputs_read(call: SubgraphCall) -> list[tuple[fx.Node, int]]:
    """(subgraph call, output index) of each operand of `call` that is an output of a subgraph call."""
    found = []
    for a in call.operands:
        source = output_of(a) if isinstance(a, fx.Node) else None
        if source is not None and SubgraphCall.of(source[0]) is not None:
            found.append(source)
    return found


def _plan(fw: SubgraphCall, bw: SubgraphCall, params: set[int]) -> tuple[list[int], list[int]]:
    """(the backward call's operand positions filled by forward outputs computed from parameters alone, the forward
    placeholders — parameters — those are computed from)."""
    placeholders = list(fw.module().graph.find_nodes(op="placeholder"))
    (outputs,) = fw.module().graph.output_node().args
    dropped, added = [], set()
    for i, a in enumerate(bw.operands):
        source = output_of(a) if isinstance(a, fx.Node) else None
        if source is None or source[0] is not fw.node:
            continue
        sources = _sources(outputs[source[1]])
        if sources is not None and all(placeholders.index(p) in params for p in sources):
            dropped.append(i)
            added.update(placeholders.index(p) for p in sources)
    return dropped, sorted(added)


def _sources(node: fx.Node) -> set[fx.Node] | None:
    """The placeholders `node` is computed from, or None when it also depends on anything impure or made from
    nothing (random numbers, constants)."""
    if node.op == "placeholder":
        return {node}
    if node.op != "call_function" or node.is_impure() or not node.all_input_nodes:
        return None
    found: set[fx.Node] = set()
    for arg in node.all_input_nodes:
        sub = _sources(arg)
        if sub is None:
            return None
        found |= sub
    return found


def _recompute(fw: SubgraphCall, bw: SubgraphCall, plan: tuple[list[int], list[int]]) -> None:
    """Rewrite `bw`'s body by `plan`: new placeholders after its others for the parameters, and the dropped inputs
    computed from them as `fw`'s body computed them."""
    dropped, added = plan
    fw_body, bw_body = fw.module(), bw.module()
    fw_placeholders = list(fw_body.graph.find_nodes(op="placeholder"))
    (outputs,) = fw_body.graph.output_node().args
    bw_placeholders = list(bw_body.graph.find_nodes(op="placeholder"))
    env: dict[fx.Node, fx.Node] = {}
    with bw_body.graph.inserting_after(bw_placeholders[-1]):
        for k in reversed(added):  # each right after the last original one: they end up in order
            env[fw_placeholders[k]] = new = bw_body.graph.placeholder(f"gathered_{k}")
            new.meta.update(fw_placeholders[k].meta)
    first_op = next(n for n in bw_body.graph.nodes if n.op != "placeholder")
    for i in dropped:
        _, index = output_of(bw.operands[i])
        value = outputs[index]
        needed = _ancestors(value)
        with bw_body.graph.inserting_before(first_op):
            for node in fw_body.graph.nodes:  # graph order: inputs before their users
                if node in needed and node not in env:
                    env[node] = bw_body.graph.node_copy(node, env.__getitem__)
        bw_placeholders[i].replace_all_uses_with(env[value])
        bw_body.graph.erase_node(bw_placeholders[i])
    bw_body.graph.lint()
    bw_body.recompile()


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """`node` and every node it is computed from."""
    found, stack = {node}, [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in found:
                found.add(arg)
                stack.append(arg)
    return found


def saved_inputs_from_callers(joint: fx.GraphModule) -> None:
    """After AOTAutograd partitioned a block's subgraph: what a forward call saves for its backward that is one of
    the call's own inputs (the block's input activation), or a view of one, is read from the calling graph instead
    of from the call's outputs.

    The partitioned forward subgraph returns such a tensor as an output aliasing its input, and Inductor lowers each
    output of an `invoke_subgraph` call as a buffer of its own (`ir.InvokeSubgraph.create`): the calling graph frees
    the input after the call and reuses its memory while the output saved for backward still points at it, so the
    backward reads whatever was written there later (wrong gradients for every block below the last). Read from the
    caller, the input itself is saved (or recomputed) and stays alive until the backward."""
    graph = joint.graph
    for fw in [c for c in map(SubgraphCall.of, graph.nodes) if c is not None]:
        if not fw.identifier.startswith(PARTITIONED_FW):
            continue
        body = fw.module()
        placeholders = list(body.graph.find_nodes(op="placeholder"))
        (outputs,) = body.graph.output_node().args
        for out in list(fw.node.users):
            source = output_of(out)
            chain = None if source is None or not out.users else _view_chain(outputs[source[1]])
            value = None if chain is None else fw.operands[placeholders.index(chain[0])]
            if not isinstance(value, fx.Node):
                continue
            for view in chain[1:]:
                with graph.inserting_before(out):
                    value = graph.node_copy(view, lambda _, base=value: base)
            out.replace_all_uses_with(value)
            graph.erase_node(out)
    graph.lint()
    joint.recompile()


def _view_chain(node: fx.Node) -> list[fx.Node] | None:
    """[placeholder, view of it, view of that, ..., `node`] when `node` is a placeholder or a chain of views of one
    (each taking no other node), else None."""
    if not isinstance(node, fx.Node):
        return None
    chain = [node]
    while node.op != "placeholder":
        if node.op != "call_function" or not _is_view(node) or node.all_input_nodes != [node.args[0]]:
            return None
        node = node.args[0]
        chain.append(node)
    return chain[::-1]


def _is_view(node: fx.Node) -> bool:
    """Whether `node` calls an operator whose one result aliases its first argument without writing it."""
    schema = op_schema(node.target)
    if schema is None or len(schema.returns) != 1 or not schema.arguments:
        return False
    result, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return result is not None and first is not None and not result.is_write and result.before_set == first.before_set
