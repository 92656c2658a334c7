"""Sharded stage modules driven by torch's pipeline schedules (`torch.distributed.pipelining`) as FSDP2's are."""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2_compile._torch_private import FullyShardStateView, set_fully_shard_state
from fsdp2_compile._torch_private import functional_collectives as funcol
from fsdp2_compile.core.ops import (
    GRAD_RECEIVERS,
    divide_factors,
    reduce_input,
    run_all_reduce_hook,
    take_pending_grad,
)
from fsdp2_compile.runtime.param_state import ParamInfo, ShardState, is_sharded, managed_params, state_of

__all__ = ["reduce_kept_grads", "register_state_views"]


# A schedule recognises an FSDP2 stage by `isinstance(module, FSDPModule)` (ours derives from torch's), runs every
# micro-batch's backward with `set_requires_gradient_sync(False)` (each rank keeps the unsharded gradients: the
# compiled backward honours the flag when it runs, `compiler/unsynced_backward.py`), then, after the step's last
# backward, turns sync on and calls what it knows of FSDP2's state (`_torch_private.FullyShardStateView`). `shard`
# registers such a view on each module it shards as that state (`register_state_views`); its
# `post_backward` reduces the gradients the step's backwards kept, one reduce-scatter per group (per `shard` call)
# as FSDP2's does, with the numerics of the compiled reduction (`ops.reduce_grad`, fused as `bucket_collectives`
# fuses a group's reduce-scatters).
def register_state_views(state: ShardState) -> None:
    """Make each module of `state` (one `shard` call) look like an FSDP2 stage module to torch's pipeline
    schedules: its state's `post_backward` reduces the gradients the step's backwards kept."""
    view = _view(weakref.ref(state))
    for ref in state.members:
        set_fully_shard_state(ref(), view)


def _view(state: weakref.ref) -> FullyShardStateView:
    def all_states() -> list[FullyShardStateView]:  # every group under this one's first module: the stage module
        root = state().members[0]()
        states = {id(state_of(m)): state_of(m) for m in root.modules() if is_sharded(m)}
        return [_view(weakref.ref(s)) for s in states.values()]

    return FullyShardStateView(post_backward=lambda: reduce_kept_grads(state()), all_states=all_states)


def _bucket_key(info: ParamInfo) -> tuple:
    if info.replicate_size > 1 and not info.requires_all_reduce:
        raise NotImplementedError(
            f"fsdp2_compile: parameter '{info.fqn}': pipeline schedules with HSDP's set_requires_all_reduce(False) "
            "are not supported; leave the all-reduce on"
        )
    divide = float(info.grad_divide_factor or 0)
    return (
        info.reduce_dtype,
        info.world_size,
        info.group_name,
        info.replicate_size,
        info.replicate_group_name,
        divide,
        info.force_sum_reduction,
        info.all_reduce_hook,
    )


def reduce_kept_grads(state: ShardState) -> None:
    """Reduce the unsharded gradients the parameters of `state` (one `shard` call) kept with gradient sync off,
    and add each rank's shard to its parameter's `.grad`; one reduce-scatter per dtype and process group. Also
    frees what backward kept gathered (`set_reshard_after_backward(False)`), as FSDP2's post-backward does."""
    params = {id(info): p for ref in state.members for _, p, info in managed_params(ref())}
    buckets: dict[tuple, list[tuple[ParamInfo, torch.Tensor]]] = defaultdict(list)
    for info in state.infos:
        if info.reshard_after_backward:
            info.drop_kept()
        if not info.requires_gradient_sync or not info.pending_key:
            continue
        grad = take_pending_grad(info.pending_key)
        if grad is not None:
            buckets[_bucket_key(info)].append((info, grad))
    for key, members in buckets.items():
        for info, shard in zip((i for i, _ in members), _reduce_bucket(key, [g for _, g in members])):
            _add_grad(info, params[id(info)], shard)


def _reduce_bucket(key: tuple, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's padded shard of the reduction, in the reduce dtype."""
    reduce_dtype, world, group, replicate_size, replicate_group, divide, force_sum, hook = key
    d = divide_factors(reduce_dtype, world, replicate_size, divide, force_sum)
    per_rank = [reduce_input(grad, reduce_dtype, world, d).view(world, -1) for grad in grads]
    reduced = funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.cat(per_rank, 1).view(-1), d.op, world, group))
    if replicate_size > 1:
        reduced = funcol.wait_tensor(funcol.all_reduce(reduced, d.op, replicate_group))
    if hook:
        reduced = run_all_reduce_hook(reduced, hook, "")
    shards, offset = [], 0
    for grad, x in zip(grads, per_rank):
        width = x.shape[1]
        shard = reduced[offset : offset + width].view(-1, *grad.shape[1:])
        if d.post is not None:
            shard = shard / d.post
        shards.append(shard)
        offset += width
    return shards


def _add_grad(info: ParamInfo, param: nn.Parameter, shard: torch.Tensor) -> None:
    rows = param.to_local().shape[info.shard_dim]
    local = shard[:rows].movedim(0, info.shard_dim).to(param.dtype).to(param.device)
    if info.grad_key:
        GRAD_RECEIVERS[info.grad_key](local)
        return
    with torch.no_grad():
        if param.grad is None:
            param.grad = DTensor.from_local(
                local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        else:
            param.grad.to_local().add_(local)
