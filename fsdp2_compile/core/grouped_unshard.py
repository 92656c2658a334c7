"""One gather op and one reduce op per block call through AOTAutograd, one op per parameter after."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch
from torch import Tensor

from fsdp2_compile._torch_private import dtensor_layout, dtensor_of
from fsdp2_compile.core.group_caches import dropped_with_groups
from fsdp2_compile.core.op_args import op_view
from fsdp2_compile.core.ops import ParamSpec, UnshardArgs, shard_grad, unshard, unshard_backward_context

__all__ = [
    "GROUPS",
    "GatherGroup",
    "gather_group",
    "REDUCE_GROUP",
    "REDUCTIONS",
    "UNSHARD_GROUP",
    "ReduceGroupArgs",
    "UnshardGroupArgs",
    "group_key",
]

# AOTAutograd traces the calling graph of identical blocks (`block_gathers.py`) twice (metadata, then the joint
# graph), and every custom op call costs it about a millisecond under its functionalization, proxy and fake modes:
# on a 32-layer GPT one `fsdp2::unshard` and one `fsdp2::reduce_grad` per block parameter were most of the joint
# trace, and DTensor's `to_local` (an autograd function) before each. `gather_outside_blocks` therefore gathers the
# trained parameters of a block call that are neither kept gathered nor delivered their gradient with one
# `GatherGroup` autograd node over the DTensor parameters: it reads their local shards and calls one
# `fsdp2::unshard_group` (the shards and a key into `GROUPS`, each parameter's `ParamSpec`). Its backward is one
# `fsdp2::reduce_group` over the same parameters (`REDUCTIONS`), which does for each what `fsdp2::unshard`'s backward
# does (`ops.shard_grad`). Before the partitioner tags the gathers (and in an inference graph before the passes),
# `compiler/group_split.py` puts back one `fsdp2::unshard` per parameter; right after it, `split_reduce_groups` puts
# back each parameter's backward ops, made by the same `ops.shard_grad`: nothing after sees a group.
GROUPS: dict[str, tuple[ParamSpec, ...]] = dropped_with_groups({})
"""By key: the `ParamSpec` of each shard a group gathers, in order."""


def group_key(specs: Sequence[ParamSpec]) -> str:
    """The key of a group of parameters with these specs (registered in `GROUPS`)."""
    key = repr(tuple(specs))
    GROUPS.setdefault(key, tuple(specs))
    return key


_BOUND: dict[str, tuple] = dropped_with_groups({})
"""By key: `GROUPS[key]` as `UnshardArgs` without a shard. Static facts only (names, sizes, dtypes, group names): no
tensor or graph; emptied with the process groups, like `GROUPS` and `REDUCTIONS`."""


def _bound(key: str) -> tuple:
    """`GROUPS[key]` as `UnshardArgs` (no shard): bound once per group, not at every trace of a call."""
    if key not in _BOUND:
        _BOUND[key] = tuple(UnshardArgs(shard=None, spec=spec) for spec in GROUPS[key])
    return _BOUND[key]


@torch.library.custom_op("fsdp2::unshard_group", mutates_args=())
def unshard_group(shards: list[Tensor], key: str) -> list[Tensor]:
    """`fsdp2::unshard` of each shard with the spec `GROUPS[key]` holds for it."""
    return [unshard(shard, spec) for shard, spec in zip(shards, GROUPS[key])]


@unshard_group.register_fake
def _(shards, key):
    return [
        shard.new_empty(
            (a.dim0, *shard.shape[1:]), dtype=a.param_dtype or shard.dtype, device=a.compute_device or shard.device
        )
        for shard, a in zip(shards, _bound(key))
    ]


REDUCTIONS: dict[str, tuple[SimpleNamespace, ...]] = dropped_with_groups({})
"""By key: what the backward of each parameter of a group needs (`ops.unshard_backward_context`), in order."""


@torch.library.custom_op("fsdp2::reduce_group", mutates_args=())
def reduce_group(grads: list[Tensor], key: str) -> list[Tensor]:
    """Each shard's gradient (`ops.shard_grad`) for the full gradients `grads` of the parameters `REDUCTIONS[key]`
    describes. Side effects: those of `fsdp2::stash_grad` / `fsdp2::add_pending_grad` (gradient sync off, or on
    after unsynced micro-batches), so the op is marked with `torch.fx.node.has_side_effect`."""
    return [shard_grad(facts, grad) for facts, grad in zip(REDUCTIONS[key], grads)]


@reduce_group.register_fake
def _(grads, key):
    return [
        grad.new_empty(
            (f.reduce.local_rows, *grad.shape[1:]),
            dtype=f.reduce.out_dtype,
            device=(f.reduce.out_device if f.sync else None) or grad.device,
        )
        for f, grad in zip(REDUCTIONS[key], grads)
    ]


REDUCE_GROUP = torch.fx.node.has_side_effect(torch.ops.fsdp2.reduce_group.default)


def _reduction(key: str, shards: Sequence[Tensor]) -> str:
    """The key of `REDUCTIONS` for the group `key` gathering these shards (registered on first use)."""
    reduction = f"{key} {[(tuple(s.shape), s.dtype, s.device) for s in shards]}"
    if reduction not in REDUCTIONS:
        # one input each: the backward reads the shard's gradient only (there is no grad anchor in a group)
        REDUCTIONS[reduction] = tuple(
            unshard_backward_context(a.replace(shard=shard), 1) for shard, a in zip(shards, _bound(key))
        )
    return reduction


class GatherGroup(torch.autograd.Function):
    """`fsdp2::unshard_group` of DTensor parameters' local shards, as one autograd node (instead of a `to_local`
    per parameter and the group op after them: AOTAutograd traces each autograd node twice, and a block has
    ~10 parameters). Its backward is one `fsdp2::reduce_group`, whose shard gradients go back as DTensors laid out
    as the parameters, as `to_local`'s backward makes them. Call it as `GatherGroup.apply(key, *params)`."""

    @staticmethod
    def forward(ctx, key: str, *params: Tensor) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # a parameter the block does not use gets None, not zeros
        shards = [p.to_local() for p in params]  # autograd is off in here: each DTensor's own local tensor
        ctx.reduction = _reduction(key, shards)
        ctx.layouts = [dtensor_layout(p) for p in params]
        return tuple(unshard_group(shards, key))

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[None | Tensor, ...]:
        facts = REDUCTIONS[ctx.reduction]
        if any(g is None for g in grads):  # a parameter the block did not use: the others reduced one by one
            local = [None if g is None else shard_grad(f, g) for f, g in zip(facts, grads)]
        else:
            local = torch.ops.fsdp2.reduce_group(list(grads), ctx.reduction)
        return None, *(None if g is None else dtensor_of(g, layout) for g, layout in zip(local, ctx.layouts))


def gather_group(key: str, *params: Tensor) -> tuple[Tensor, ...]:
    """`GatherGroup.apply(key, *params)` as a function FX can name in generated code (the bound `apply` has no
    module)."""
    return GatherGroup.apply(key, *params)


UNSHARD_GROUP = torch.ops.fsdp2.unshard_group.default


UnshardGroupArgs = op_view(
    "UnshardGroupArgs",
    UNSHARD_GROUP,
    "Arguments of `fsdp2::unshard_group`: a block call's shards and the key of "
    "their static facts (before AOTAutograd's partition only).",
)
ReduceGroupArgs = op_view(
    "ReduceGroupArgs", REDUCE_GROUP, "Arguments of `fsdp2::reduce_group` (GatherGroup's backward, until split)."
)
