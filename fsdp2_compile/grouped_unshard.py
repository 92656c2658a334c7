"""One `fsdp2::unshard_group` per block call through AOTAutograd, one `fsdp2::unshard` per parameter after.

AOTAutograd traces the calling graph of identical blocks (`compiled_once.py`) twice (metadata, then the joint
graph), and every custom op call costs it about a millisecond under its functionalization, proxy and fake modes:
on a 32-layer GPT one `fsdp2::unshard` per block parameter was most of the joint trace. `gather_outside_blocks`
therefore gathers the plain parameters of a block call (no kept gathered copy, no delivered gradient) with one
`unshard_group` node, whose arguments are the shards and a key into `GROUPS` (each parameter's static arguments of
`fsdp2::unshard`). Its backward is each parameter's own (`ops.unshard_backward`), so the backward graph reduces
per parameter as before. `split_unshard_groups` then replaces each group by the `fsdp2::unshard` nodes it stands
for (before the partitioner tags them, and in an inference graph before the passes): nothing after it sees a group.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch
from torch import Tensor, fx

from .ops import unshard, unshard_backward, unshard_backward_context

__all__ = ["GROUPS", "UNSHARD_GROUP", "group_key", "split_unshard_groups"]

GROUPS: dict[str, tuple[tuple, ...]] = {}
"""By key: the static arguments of `fsdp2::unshard` (after the shard, before `gathered`) of each shard a group
gathers, in order."""


def group_key(static_args: Sequence[tuple]) -> str:
    """The key of a group of parameters with these static arguments (registered in `GROUPS`)."""
    key = repr(tuple(static_args))
    GROUPS.setdefault(key, tuple(static_args))
    return key


@functools.cache
def _bound(key: str) -> tuple:
    """`GROUPS[key]` as `UnshardArgs` (no shard): bound once per group, not at every trace of a call."""
    from .ir import UnshardArgs

    return tuple(UnshardArgs.bind((None, *args)) for args in GROUPS[key])


@torch.library.custom_op("fsdp2::unshard_group", mutates_args=())
def unshard_group(shards: list[Tensor], key: str) -> list[Tensor]:
    """`fsdp2::unshard` of each shard with the static arguments `GROUPS[key]` holds for it."""
    return [unshard(shard, *args) for shard, args in zip(shards, GROUPS[key])]


@unshard_group.register_fake
def _(shards, key):
    return [shard.new_empty((a.dim0, *shard.shape[1:]), dtype=a.param_dtype or shard.dtype,
                            device=a.compute_device or shard.device) for shard, a in zip(shards, _bound(key))]


def _setup_context(ctx, inputs, output) -> None:
    shards, key = inputs
    # one input each: `_backward` reads the shard's gradient only (there is no grad anchor in a group)
    ctx.each = [unshard_backward_context(a.replace(shard=shard), 1) for shard, a in zip(shards, _bound(key))]


def _backward(ctx, grads):
    return [None if g is None else unshard_backward(c, g)[0] for c, g in zip(ctx.each, grads)], None


unshard_group.register_autograd(_backward, setup_context=_setup_context)

UNSHARD_GROUP = torch.ops.fsdp2.unshard_group.default


def split_unshard_groups(gm: fx.GraphModule) -> None:
    """Replace every `fsdp2::unshard_group` of `gm` (and its `getitem`s) by one `fsdp2::unshard` per shard."""
    from .ir import UNSHARD

    groups = list(gm.graph.find_nodes(op="call_function", target=UNSHARD_GROUP))
    for group in groups:
        shards, key = group.args
        for user in list(group.users):
            if user.target is not operator.getitem:
                raise RuntimeError(f"fsdp2_compile: {user.format_node()} reads an unshard group whole")
            i = user.args[1]
            with gm.graph.inserting_before(user):
                node = gm.graph.call_function(UNSHARD, (shards[i], *GROUPS[key][i]))
            node.meta.update(group.meta)
            node.meta.update(user.meta)
            user.replace_all_uses_with(node)
            gm.graph.erase_node(user)
        gm.graph.erase_node(group)
    if groups:
        gm.graph.lint()
        gm.recompile()
