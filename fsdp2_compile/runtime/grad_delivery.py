"""Optimizer in backward: a parameter's reduced gradient handed to it right after its reduce-scatter, where FSDP2's
`foreach_reduce` sets `.grad` and runs the post-accumulate-grad hooks.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import fx
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from fsdp2_compile._torch_private import post_accumulate_grad_hooks, queue_at_backward_end
from fsdp2_compile.core.fx_edit import fold_repeated_unshards
from fsdp2_compile.core.ops import GRAD_RECEIVERS

__all__ = ["GRAD_ANCHORS", "HOOKS_AFTER_BACKWARD", "one_unshard_per_delivered_param", "receive_grads"]

HOOKS_AFTER_BACKWARD = "/hooks-after-backward"
"""Appended to a `grad_key` by an eager forward: a parameter read outside its group's forward is gathered and
reduced once per read (`eager_reads.py` folds the reads inside it), so its hooks run once, when the backward ends."""

GRAD_ANCHORS: dict[str, torch.Tensor] = {}
"""By device (its text): the zero scalar that requires grad every delivered parameter's `fsdp2::unshard` takes."""


# Autograd would run those hooks only once the whole compiled backward has returned all gradients, and also after a
# backward with gradient sync off (with a zero gradient). For a parameter with hooks (`ParamInfo.grad_key`, refreshed
# before every forward), `fsdp2::unshard` reads the parameter detached and also takes a grad anchor (a zero scalar
# that requires grad), and its backward ends in `fsdp2::deliver_grad` instead of returning the shard's gradient: the
# parameter is not in autograd's graph (its engine runs no hook of its own), the anchor gets the zero each delivery
# returns, which keeps the deliveries in the partitioned backward graph, where the scheduler places each after its
# bucket's reduction. Eager forwards deliver the same way but run the hooks when the backward ends.
def receive_grads(grad_key: str, param: DTensor) -> DTensor:
    """Register `param` as the receiver of the gradients delivered under `grad_key` (and make its device's anchor).
    Returns the parameter detached (sharing its storage, so it sees every optimizer update): what a compiled graph
    reads, so that autograd does not connect the graph to the parameter (its engine would run the hooks once more,
    with no gradient, when the compiled backward returns)."""
    receiver = GRAD_RECEIVERS.get(grad_key)
    if not isinstance(receiver, _GradReceiver) or receiver.param() is not param:
        receiver = GRAD_RECEIVERS[grad_key] = _GradReceiver(weakref.ref(param), param.detach())
        GRAD_RECEIVERS[grad_key + HOOKS_AFTER_BACKWARD] = functools.partial(receiver, hooks_now=False)
    if str(param.device) not in GRAD_ANCHORS:
        anchor = torch.zeros((), device=param.device, requires_grad=True)
        anchor.register_post_accumulate_grad_hook(lambda t: setattr(t, "grad", None))
        GRAD_ANCHORS[str(param.device)] = anchor
    return receiver.detached


@dataclass(frozen=True)
class _GradReceiver:
    """Takes a reduced gradient shard as FSDP2 does: set or add to `.grad` (a DTensor of the parameter's layout),
    then run the parameter's post-accumulate-grad hooks."""

    param: weakref.ref
    detached: DTensor

    def __call__(self, local: torch.Tensor, hooks_now: bool = True) -> None:
        param = self.param()
        if param is None:
            return
        grad = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)
        if hooks_now:
            _run_hooks(param)
            return
        if not _HOOKS_PENDING:
            queue_at_backward_end(_run_pending_hooks)
        _HOOKS_PENDING[param] = None


_HOOKS_PENDING = WeakIdKeyDictionary()
"""Parameters whose hooks run when the current (eager) backward ends, in the order their gradients came."""


def discard_pending_hooks(params) -> None:
    """Forget the hooks of `params` queued for a backward that raised before its end (`reset_iter_state`)."""
    for param in params:
        _HOOKS_PENDING.pop(param, None)


def _run_pending_hooks() -> None:
    params = list(_HOOKS_PENDING)
    _HOOKS_PENDING.clear()
    for param in params:
        _run_hooks(param)


def _run_hooks(param: DTensor) -> None:
    for hook in post_accumulate_grad_hooks(param):
        hook(param)


def one_unshard_per_delivered_param(gm: fx.GraphModule) -> None:
    """Before AOTAutograd: a delivered parameter read several times (tied weights) is gathered by its first
    `fsdp2::unshard` for every read, so autograd sums its gradients before the one reduction and delivery (the
    passes' `combine_tied_grads` would meet two deliveries it cannot merge)."""
    fold_repeated_unshards(gm.graph, lambda call: bool(call.grad_key) and call.gathered is None)
    gm.recompile()
