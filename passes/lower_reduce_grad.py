"""Lower every `fsdp2::reduce_grad` into `[cast to reduce_dtype] → [pad] → reduce_scatter_tensor(avg) →
wait_tensor → [all_reduce(avg) over the HSDP replicate group → wait_tensor] → [the user's all-reduce hook,
`fsdp2::run_all_reduce_hook`] → [unpad] → [cast to param dtype] → [copy to the CPU shard's device]`;
with a gradient divide factor f, `[× 1/f]` after the cast and "sum" instead of "avg"; in fp16 or with
`set_force_sum_reduction_for_comms`, sums with `[÷ p]` before and `[÷ f/p]` after (`ops.divide_factors`). A shard
group of one rank has no reduce-scatter, no padding and no copy beyond a contiguous one where the gradient is not:
as in FSDP2, the gradient is divided by f instead of scaled by 1/f (`DivideFactors.alone`). HSDP with the all-reduce
off (`set_requires_all_reduce(False)`): the reduced shard goes to `fsdp2::stash_grad` (kept, a zero shard on);
with it on after such backwards, `fsdp2::add_pending_grad` adds what was kept before the all-reduce.

A no-op on graphs without gradients. Every node it inserts carries `ir.Tags` (`fsdp.params`, `fsdp.bucket`,
`fsdp.role`); the result is this rank's shard of the averaged gradient. Tied gradients must be summed first
(`combine_tied_grads`), so each parameter is reduced once.
"""

from __future__ import annotations

import torch
from torch import fx

from fsdp2_compile._torch_private import to_copy
from fsdp2_compile.compiler.pass_api import Fact, PassContext, contract
from fsdp2_compile.core.fx_edit import insert_call, insert_contiguous, insert_op, nodes_calling, val
from fsdp2_compile.core.ir import (
    REDUCE_GRAD,
    AddPendingGradArgs,
    AllReduceArgs,
    ReduceGradArgs,
    ReduceScatterArgs,
    Role,
    RunAllReduceHookArgs,
    StashGradArgs,
    Tags,
    WaitArgs,
)
from fsdp2_compile.core.ops import divide_factors, padded_rows

aten = torch.ops.aten
convert = torch.ops.prims.convert_element_type.default


@contract(requires=(Fact.TIED_GRADS_COMBINED,), provides=(Fact.REDUCE_GRAD_LOWERED,))
def lower_reduce_grad(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    for node in nodes_calling(graph, REDUCE_GRAD):
        a = ReduceGradArgs.of(node)
        tag = Tags((a.fqn,), a.bucket).meta
        rows = padded_rows(val(a.grad).shape[0], a.world_size)
        with graph.inserting_before(node):
            x = a.grad
            if val(x).dtype != a.reduce_dtype:
                x = insert_call(graph, convert, (x, a.reduce_dtype), tag(Role.CAST))
            d = divide_factors(a.reduce_dtype, a.world_size, a.replicate_size, a.divide_factor, a.force_sum_reduction)
            if d.scale is not None:
                x = insert_call(graph, aten.mul.Tensor, (x, d.scale), tag(Role.CAST))
            if d.pre is not None:
                x = insert_call(graph, aten.div.Tensor, (x, d.pre), tag(Role.CAST))
            if d.alone is not None:
                x = insert_call(graph, aten.div.Tensor, (x, d.alone), tag(Role.CAST))
            missing = rows * a.world_size - val(x).shape[0]
            if missing:
                pad = [0, 0] * (val(x).dim() - 1) + [0, missing]
                x = insert_call(graph, aten.constant_pad_nd.default, (x, pad), tag(Role.PAD))
            x = insert_contiguous(graph, x, tag(Role.CONTIGUOUS))
            if a.world_size > 1:  # over one rank the gradient is its own reduction
                x = insert_op(graph, ReduceScatterArgs(x, d.op, a.world_size, a.group_name), tag(Role.REDUCE_SCATTER))
                x = insert_op(graph, WaitArgs(x), tag(Role.WAIT))
            stashed = a.replicate_size > 1 and not a.requires_all_reduce  # HSDP accumulation: keep the reduced shard
            if stashed:
                x = insert_op(
                    graph, StashGradArgs(x, a.partial_key, a.reduce_dtype, rows, a.reduce_dtype, a.fqn), tag()
                )
            elif a.replicate_size > 1:
                if a.partial_key:
                    x = insert_op(graph, AddPendingGradArgs(x, a.partial_key, a.reduce_dtype, a.fqn), tag())
                x = insert_op(graph, AllReduceArgs(x, d.op, a.replicate_group_name), tag(Role.ALL_REDUCE))
                x = insert_op(graph, WaitArgs(x), tag(Role.WAIT))
            if a.all_reduce_hook and not stashed:
                x = insert_op(graph, RunAllReduceHookArgs(x, a.all_reduce_hook, a.fqn), tag(Role.ALL_REDUCE_HOOK))
            if d.post is not None and not stashed:  # a kept shard is divided after its later all-reduce
                x = insert_call(graph, aten.div.Tensor, (x, d.post), tag(Role.CAST))
            if a.local_rows != rows:
                x = insert_call(graph, aten.slice.Tensor, (x, 0, 0, a.local_rows), tag(Role.UNPAD))
            if a.reduce_dtype != a.out_dtype:
                x = insert_call(graph, convert, (x, a.out_dtype), tag(Role.CAST))
            if a.out_device is not None and a.out_device != val(x).device:
                x = insert_call(graph, to_copy.default, (x,), tag(Role.TO_DEVICE), {"device": a.out_device})
        node.replace_all_uses_with(x)
        graph.erase_node(node)
    return gm
