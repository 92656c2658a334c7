"""The custom ops the capture sees: `fsdp2::unshard` and its autograd twin `fsdp2::reduce_grad`, the two that
gradient accumulation without sync uses, `fsdp2::stash_grad` / `fsdp2::add_pending_grad`, the two that keep
parameters gathered after backward, `fsdp2::keep_unsharded` / `fsdp2::release_unsharded`, `fsdp2::deliver_grad`,
which hands a reduced gradient to its parameter inside backward (optimizer in backward), `fsdp2::run_all_reduce_hook`,
which runs a user's hook on reduced gradients (`FSDPModule.set_all_reduce_hook`), and `fsdp2::keep_alive`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fsdp2_compile._torch_private import functional_collectives as _funcol
from fsdp2_compile._torch_private import grads_summed_in_reduce_dtype, register_value_type
from fsdp2_compile.core.group_caches import dropped_with_groups
from fsdp2_compile.core.op_args import OpArgs, op_view

__all__ = [
    "ADD_PENDING_GRAD",
    "ALL_REDUCE_HOOKS",
    "AddPendingGradArgs",
    "DeliverGradArgs",
    "KeepAliveArgs",
    "KeepUnshardedArgs",
    "ParamSpec",
    "ReduceGradArgs",
    "ReleaseUnshardedArgs",
    "RunAllReduceHookArgs",
    "StashGradArgs",
    "UnshardArgs",
    "DELIVER_GRAD",
    "GRAD_RECEIVERS",
    "KEEP_ALIVE",
    "KEEP_UNSHARDED",
    "KEPT_UNSHARDED",
    "RELEASE_UNSHARDED",
    "REDUCE_GRAD",
    "RUN_ALL_REDUCE_HOOK",
    "STASH_GRAD",
    "UNSHARD",
    "add_pending_grad",
    "all_reduce_hook_key",
    "deliver_grad",
    "discard_pending_grad",
    "divide_factors",
    "keep_alive",
    "keep_unsharded",
    "release_unsharded",
    "pad_rows",
    "pending_grad_keys",
    "padded_rows",
    "reduce_grad",
    "reduce_input",
    "run_all_reduce_hook",
    "stash_grad",
    "take_pending_grad",
    "unshard",
]


def padded_rows(dim0: int, world_size: int) -> int:
    """Rows of every rank's padded shard: ceil(dim0 / world_size), the chunk size of `torch.chunk`."""
    return -(-dim0 // world_size)


def pad_rows(t: Tensor, rows: int) -> Tensor:
    """`t` zero-padded on dim 0 to `rows` rows (returned as is when it already has them)."""
    missing = rows - t.shape[0]
    if missing == 0:
        return t
    return torch.constant_pad_nd(t, [0, 0] * (t.dim() - 1) + [0, missing])


# `unshard(shard)` returns the full parameter (all ranks' shards, cast to `param_dtype`); its backward is
# `reduce_grad(grad)`, which returns this rank's shard of the averaged gradient in the parameter's dtype.
# With gradient sync off (`set_requires_gradient_sync(False)`, as in FSDP2) the backward instead adds the unsharded
# gradient to one kept on this rank (`stash_grad`, no communication) and gives the shard a zero gradient; the next
# synced backward adds what was kept before reducing (`add_pending_grad`). Reduction is linear, so the result is
# the reduction of the summed gradients.
# Both run eagerly (through the functional collectives, so eager and compiled runs issue the same collectives)
# and have fake implementations, so Dynamo/AOTAutograd trace them as single opaque nodes that the lowering
# passes later expand into cast / pad / collective / wait / unpad nodes.
#
# Besides its tensors, `fsdp2::unshard` takes one static argument, the parameter's `ParamSpec`, carried in the op so
# each node names its parameter (`fqn`) and its FSDP group (`bucket`: the module `shard` was called on), and the
# partitioner can read `reshard_after_forward` off the node itself.
@register_value_type
@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Everything `fsdp2::unshard` needs of a parameter besides its shard: one static, named argument, which
    Dynamo bakes into the graph as a constant and guards by equality (a registered opaque value type).

    Only the backward uses the fields after `reshard_after_forward`: `replicate_*` name the HSDP replicate group
    (`1` / `""` without one); `requires_grad_sync=False` keeps the gradient unsharded under `pending_key` instead
    of reducing it, and a synced backward with a `pending_key` adds what was kept first. `prefetch_*`:
    comma-separated buckets whose all-gathers the scheduler issues right before this parameter's bucket is used
    (explicit prefetching). `grad_divide_factor` (0: average): the gradient is summed over the ranks after each is
    multiplied by 1/it. `force_sum_reduction` (`set_force_sum_reduction_for_comms`): sum-only collectives
    (`divide_factors`). HSDP: `requires_all_reduce=False` keeps the reduce-scattered shard under `partial_key`
    instead of all-reducing it; a backward with the all-reduce adds what was kept first. `post_forward_*`
    (`reshard_after_forward=int`): the smaller group compiled backwards gather from (`post_forward.py`); eager runs
    gather from the whole group. `compute_device` (`CPUOffloadPolicy` on an accelerator mesh): where the CPU shard
    is copied before all else. `reshard_after_backward=False`: backward keeps the gathered parameter under
    `kept_key`; the next forward passes it as `gathered` and gathers nothing (`unsharded_after_backward.py`).
    `grad_key` (with the op's `grad_anchor`, a parameter with post-accumulate-grad hooks): backward hands the
    reduced gradient to the parameter itself and runs its hooks (`deliver_grad`), as FSDP2 does after each
    reduce-scatter; the shard gets no gradient. `all_reduce_hook` (`FSDPModule.set_all_reduce_hook`): the key of
    the hook that gets the reduced shard after the HSDP all-reduce, before the division after it
    (`ALL_REDUCE_HOOKS`)."""

    dim0: int
    world_size: int
    group_name: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype
    fqn: str
    bucket: str
    reshard_after_forward: bool
    replicate_size: int = 1
    replicate_group_name: str = ""
    requires_grad_sync: bool = True
    pending_key: str = ""
    prefetch_forward: str = ""
    prefetch_backward: str = ""
    grad_divide_factor: float = 0.0
    force_sum_reduction: bool = False
    requires_all_reduce: bool = True
    partial_key: str = ""
    post_forward_size: int = 0
    post_forward_group_name: str = ""
    compute_device: torch.device | None = None
    reshard_after_backward: bool = True
    kept_key: str = ""
    grad_key: str = ""
    all_reduce_hook: str = ""

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        """The expression that rebuilds this spec in generated graph code, and the names it uses besides FX's own
        (`torch`, `device`): no module among them, so Inductor's FX graph cache can pickle them."""
        return repr(self), {"ParamSpec": ParamSpec}


@torch.library.custom_op("fsdp2::unshard", mutates_args=())
def unshard(
    shard: Tensor, spec: ParamSpec, gathered: Tensor | None = None, grad_anchor: Tensor | None = None
) -> Tensor:
    """All-gather a dim-0 shard into the full parameter of `spec.dim0` rows, cast to `spec.param_dtype` first.
    `gathered`: the parameter kept gathered after backward (`spec.kept_key`), returned instead. `grad_anchor`: the
    tensor whose gradient delivers the reduced gradient to the parameter (`spec.grad_key`)."""
    if gathered is not None:
        return gathered.clone()
    x = shard if spec.compute_device is None else shard.to(spec.compute_device, non_blocking=True)
    x = x if spec.param_dtype is None else x.to(spec.param_dtype)
    if spec.world_size == 1:  # a group of one: the shard is the parameter (a copy: an op's output aliases nothing)
        return x.clone(memory_format=torch.contiguous_format) if x is shard else x.contiguous()
    x = pad_rows(x, padded_rows(spec.dim0, spec.world_size)).contiguous()
    full = _funcol.wait_tensor(_funcol.all_gather_into_tensor(x, spec.world_size, spec.group_name))
    return full[: spec.dim0].clone() if full.shape[0] != spec.dim0 else full


@unshard.register_fake
def _(shard, spec, gathered=None, grad_anchor=None):
    return shard.new_empty(
        (spec.dim0, *shard.shape[1:]), dtype=spec.param_dtype or shard.dtype, device=spec.compute_device or shard.device
    )


class DivideFactors(NamedTuple):
    """How a gradient is reduced: times `scale`, divided by `pre`, [divided by `alone`,] reduced with `op` ("avg"
    or "sum"), the result divided by `post` (None: not done)."""

    scale: float | None
    pre: float | None
    op: str
    post: float | None
    alone: float | None = None
    """A shard group of one rank: FSDP2 copies the gradient instead of reduce-scattering it, divided by the
    gradient divide factor when one is set."""


def divide_factors(
    reduce_dtype: torch.dtype, world_size: int, replicate_size: int, divide_factor: float, force_sum: bool
) -> DivideFactors:
    """FSDP2's rule (`_get_gradient_divide_factors`). fp32 / bf16 without `force_sum`: the collective averages,
    or with a divide factor f each rank's gradient is multiplied by 1/f and summed. Otherwise only sums: in a
    dtype other than fp32 / bf16 (fp16: overflow) each rank divides by the largest power of two p with p*p < f
    (f: the divide factor, else the data-parallel size) first and the sum is divided by f/p; with `force_sum`
    in fp32 / bf16 the sum is divided by f. A shard group of one rank (`world_size == 1`) has no reduce-scatter:
    FSDP2 copies the gradient instead, divided by f when f is set (`alone`; then no `scale`), the rest as above."""
    d = _divide_factors(reduce_dtype, world_size, replicate_size, divide_factor, force_sum)
    if world_size == 1:
        return d._replace(scale=None, alone=divide_factor or None)
    return d


def _divide_factors(
    reduce_dtype: torch.dtype, world_size: int, replicate_size: int, divide_factor: float, force_sum: bool
) -> DivideFactors:
    exact = reduce_dtype in (torch.float32, torch.bfloat16)
    if exact and not force_sum:
        return (
            DivideFactors(1.0 / divide_factor, None, "sum", None)
            if divide_factor
            else DivideFactors(None, None, "avg", None)
        )
    factor = divide_factor or float(world_size * replicate_size)
    if exact:
        return DivideFactors(None, None, "sum", factor if factor != 1 else None)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    post = factor / pre
    return DivideFactors(None, pre if pre != 1 else None, "sum", post if post != 1 else None)


def reduce_input(grad: Tensor, reduce_dtype: torch.dtype, world_size: int, d: DivideFactors) -> Tensor:
    """`grad` as a reduce-scatter over `world_size` ranks takes it: in `reduce_dtype`, scaled before the reduction
    (`d.scale`, `d.pre`, `d.alone`), zero-padded on dim 0 to whole shards, contiguous. Over one rank: the reduced
    gradient itself."""
    x = grad.to(reduce_dtype)
    if d.scale is not None:
        x = x * d.scale
    if d.pre is not None:
        x = x / d.pre
    if d.alone is not None:
        x = x / d.alone
    return pad_rows(x, padded_rows(grad.shape[0], world_size) * world_size).contiguous()


@torch.library.custom_op("fsdp2::reduce_grad", mutates_args=())
def reduce_grad(
    grad: Tensor,
    local_rows: int,
    world_size: int,
    group_name: str,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
    fqn: str,
    bucket: str,
    replicate_size: int,
    replicate_group_name: str,
    divide_factor: float = 0.0,
    requires_all_reduce: bool = True,
    partial_key: str = "",
    out_device: torch.device | None = None,
    force_sum_reduction: bool = False,
    all_reduce_hook: str = "",
) -> Tensor:
    """Average a full gradient over the group and return this rank's `local_rows`-row shard in `out_dtype`.
    With an HSDP replicate group (`replicate_size > 1`) the shard is then averaged over that group too. With a
    `divide_factor`, each rank's gradient is multiplied by 1 / divide_factor and the results are summed instead.
    HSDP without the all-reduce (`requires_all_reduce=False`): the reduced shard is kept under `partial_key` (a
    zero shard back); the next reduction with the all-reduce adds it first. `out_device`: where the result goes
    (`CPUOffloadPolicy`: back to the CPU shard's device). `all_reduce_hook`: the user's hook gets the reduced
    shard before the division after the collectives, as in FSDP2. How each rank's part is scaled and summed:
    `divide_factors`."""
    d = divide_factors(reduce_dtype, world_size, replicate_size, divide_factor, force_sum_reduction)
    x = reduce_input(grad, reduce_dtype, world_size, d)
    out = x if world_size == 1 else _funcol.wait_tensor(_funcol.reduce_scatter_tensor(x, d.op, world_size, group_name))
    if replicate_size > 1 and not requires_all_reduce:
        return (
            torch.ops.fsdp2.stash_grad(out, partial_key, reduce_dtype, out.shape[0], reduce_dtype, fqn)[:local_rows]
            .to(out_dtype)
            .clone()
        )
    if replicate_size > 1:
        if partial_key:
            out = torch.ops.fsdp2.add_pending_grad(out, partial_key, reduce_dtype, fqn)
        out = _funcol.wait_tensor(_funcol.all_reduce(out, d.op, replicate_group_name))
    if all_reduce_hook:
        out = run_all_reduce_hook(out, all_reduce_hook, fqn)
    if d.post is not None:
        out = out / d.post
    return out[:local_rows].to(out_dtype).to(out_device or out.device).clone()


@reduce_grad.register_fake
def _(*args, **kwargs):
    a = ReduceGradArgs.bind(args, kwargs)
    return a.grad.new_empty((a.local_rows, *a.grad.shape[1:]), dtype=a.out_dtype, device=a.out_device or a.grad.device)


_PENDING_GRADS: dict[str, Tensor] = {}
"""Unsharded gradients accumulated while gradient sync is off, by `pending_key` (HSDP: shards kept without their
all-reduce, by `partial_key`)."""


def pending_grad_keys() -> set[str]:
    """The keys under which unsharded gradients are kept now."""
    return set(_PENDING_GRADS)


def take_pending_grad(key: str) -> Tensor | None:
    """The unsharded gradient kept under `key` (released), or None."""
    return _PENDING_GRADS.pop(key, None)


def discard_pending_grad(key: str) -> None:
    """Drop the gradient kept under `key`, if any (`FSDPModule.reset_iter_state`)."""
    _PENDING_GRADS.pop(key, None)


def _accumulated(kept: Tensor | None, grad: Tensor, reduce_dtype: torch.dtype) -> Tensor:
    """`grad` added to the gradient `kept` in `reduce_dtype` as the installed torch's FSDP2 adds them: the sum rounded
    to it, or from torch 2.15 `grad` cast first (`grads_summed_in_reduce_dtype`)."""
    if kept is None:
        return grad.to(reduce_dtype, copy=True)
    return kept + grad.to(reduce_dtype) if grads_summed_in_reduce_dtype else (kept + grad).to(reduce_dtype)


@torch.library.custom_op("fsdp2::stash_grad", mutates_args=())
def stash_grad(
    grad: Tensor, pending_key: str, reduce_dtype: torch.dtype, local_rows: int, out_dtype: torch.dtype, fqn: str
) -> Tensor:
    """Add `grad` to the unsharded gradient kept under `pending_key`, kept in `reduce_dtype` as FSDP2 keeps it
    (`_accumulated`); a zero shard back.
    Side effect: it writes module-level state (`_PENDING_GRADS`) that no argument shows, so the op is marked with
    `torch.fx.node.has_side_effect` (never dead-code eliminated, never reordered as pure). `fqn` names the
    parameter (for reports; the key is opaque)."""
    kept = _PENDING_GRADS.get(pending_key)
    _PENDING_GRADS[pending_key] = _accumulated(kept, grad, reduce_dtype)
    return grad.new_zeros((local_rows, *grad.shape[1:]), dtype=out_dtype)


@stash_grad.register_fake
def _(grad, pending_key, reduce_dtype, local_rows, out_dtype, fqn):
    return grad.new_empty((local_rows, *grad.shape[1:]), dtype=out_dtype)


@torch.library.custom_op("fsdp2::add_pending_grad", mutates_args=())
def add_pending_grad(grad: Tensor, pending_key: str, reduce_dtype: torch.dtype, fqn: str) -> Tensor:
    """`grad` plus (and releasing) the gradient kept under `pending_key`, if any, in `reduce_dtype`.
    Side effect: it reads and clears module-level state (`_PENDING_GRADS`), so the op is marked with
    `torch.fx.node.has_side_effect`. `fqn` names the parameter."""
    kept = _PENDING_GRADS.pop(pending_key, None)
    return _accumulated(kept, grad, reduce_dtype)


@add_pending_grad.register_fake
def _(grad, pending_key, reduce_dtype, fqn):
    return grad.new_empty(grad.shape, dtype=reduce_dtype)


ALL_REDUCE_HOOKS: dict[str, Callable[[Tensor], None]] = dropped_with_groups({})
"""By key: the hooks given to `FSDPModule.set_all_reduce_hook` (held until the process groups go)."""
_HOOK_KEYS: dict[int, str] = dropped_with_groups({})
"""`id(hook)` -> its key in `ALL_REDUCE_HOOKS` (which holds the hook, so the id is not reused meanwhile)."""


def all_reduce_hook_key(hook: Callable[[Tensor], None]) -> str:
    """The key of `hook` in `ALL_REDUCE_HOOKS` (registered on first use): one hook given to every block keeps one
    key, so identical blocks still trace once."""
    key = _HOOK_KEYS.get(id(hook))
    if key is None:
        key = _HOOK_KEYS[id(hook)] = f"all_reduce_hook/{len(ALL_REDUCE_HOOKS)}"
        ALL_REDUCE_HOOKS[key] = hook
    return key


@torch.library.custom_op("fsdp2::run_all_reduce_hook", mutates_args=())
def run_all_reduce_hook(reduced: Tensor, hook_key: str, fqn: str) -> Tensor:
    """A copy of the reduced gradient shard(s) `reduced` (flat for a bucket), after the hook under `hook_key` changed
    it in place (FSDP2's `set_all_reduce_hook`: e.g. an all-reduce over another group). Side effect: whatever the
    hook does (collectives), so the op is marked with `torch.fx.node.has_side_effect`. `fqn` names the
    parameters."""
    out = reduced.clone()
    ALL_REDUCE_HOOKS[hook_key](out)
    return out


@run_all_reduce_hook.register_fake
def _(reduced, hook_key, fqn):
    return torch.empty_like(reduced)


GRAD_RECEIVERS: dict[str, Callable[[Tensor], None]] = {}
"""By `grad_key`: what takes a parameter's reduced gradient shard (sets or adds to its `.grad`, runs its
post-accumulate-grad hooks; `grad_delivery.py`)."""


@torch.library.custom_op("fsdp2::deliver_grad", mutates_args=())
def deliver_grad(grad: Tensor, grad_key: str, fqn: str) -> Tensor:
    """Hand a copy of the reduced gradient shard `grad` to the parameter registered under `grad_key` (a copy: the
    compiled graph may reuse `grad`'s memory once this op has run); returns a zero scalar, the gradient of the
    grad anchor, which keeps this op in the backward graph. Side effect: the parameter's `.grad` and whatever its
    hooks do (an optimizer step), so the op is marked with `torch.fx.node.has_side_effect`."""
    GRAD_RECEIVERS[grad_key](grad.detach().clone())
    return grad.new_zeros(())


@deliver_grad.register_fake
def _(grad, grad_key, fqn):
    return grad.new_empty(())


def unshard_backward_context(a, n_inputs: int) -> SimpleNamespace:
    """What `fsdp2::unshard`'s backward needs of a call with `n_inputs` inputs and arguments `a` (`UnshardArgs`)."""
    return backward_facts(a.spec, a.shard, n_inputs, delivered=a.grad_anchor is not None)


def backward_facts(spec: ParamSpec, shard: Tensor, n_inputs: int, delivered: bool = False) -> SimpleNamespace:
    """What the backward of a gather of `shard` with `spec` needs (`shard_grad`, `unshard_backward`); `delivered`:
    it has a grad anchor, which gets the gradient (`spec.grad_key`)."""
    return SimpleNamespace(
        sync=spec.requires_grad_sync,
        pending_key=spec.pending_key,
        fqn=spec.fqn,
        grad_key=spec.grad_key if delivered else "",
        reduce=ReduceGradArgs(
            grad=None,
            local_rows=shard.shape[0],
            world_size=spec.world_size,
            group_name=spec.group_name,
            reduce_dtype=spec.reduce_dtype,
            out_dtype=shard.dtype,
            fqn=spec.fqn,
            bucket=spec.bucket,
            replicate_size=spec.replicate_size,
            replicate_group_name=spec.replicate_group_name,
            divide_factor=spec.grad_divide_factor,
            requires_all_reduce=spec.requires_all_reduce,
            partial_key=spec.partial_key,
            out_device=shard.device if spec.compute_device is not None else None,
            force_sum_reduction=spec.force_sum_reduction,
            all_reduce_hook=spec.all_reduce_hook,
        ),
        n_inputs=n_inputs,
    )


def _run(op, *args):
    return op(*args)


def shard_grad(facts: SimpleNamespace, grad: Tensor, call: Callable = _run):
    """The gradient of an `fsdp2::unshard` call's shard (`facts`: `unshard_backward_context`) for `grad`, the full
    parameter's: kept unsharded with gradient sync off (`stash_grad`), else [what was kept added, then] reduced.
    `call(op, *args)` runs each op (the default), or inserts it in a graph (`group_split.split_reduce_groups`)."""
    r = facts.reduce
    if not facts.sync:
        return call(STASH_GRAD, grad, facts.pending_key, r.reduce_dtype, r.local_rows, r.out_dtype, facts.fqn)
    if facts.pending_key:
        grad = call(ADD_PENDING_GRAD, grad, facts.pending_key, r.reduce_dtype, facts.fqn)
    return call(REDUCE_GRAD, *r.replace(grad=grad).as_args())


def unshard_backward(facts: SimpleNamespace, grad: Tensor) -> tuple:
    """The gradients of an `fsdp2::unshard` call's inputs (`facts`: `unshard_backward_context`) for `grad`."""
    reduced = shard_grad(facts, grad)
    if not facts.grad_key:
        return (reduced,) + (None,) * (facts.n_inputs - 1)  # no gradient for the spec or `gathered`
    # Delivered (FSDP2 runs the hooks only when a gradient was reduced and all-reduced), the shard gets none.
    r = facts.reduce
    delivered = facts.sync and (r.replicate_size == 1 or r.requires_all_reduce)
    anchor = torch.ops.fsdp2.deliver_grad(reduced, facts.grad_key, facts.fqn) if delivered else reduced.new_zeros(())
    return (None,) * (facts.n_inputs - 1) + (anchor,)


def _unshard_setup_context(ctx, inputs, output) -> None:
    ctx.facts = unshard_backward_context(UnshardArgs.bind(inputs), len(inputs))  # torch fills in the defaults


def _unshard_backward(ctx, grad: Tensor):
    return unshard_backward(ctx.facts, grad)


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)


KEPT_UNSHARDED: dict[str, Tensor] = {}
"""Gathered parameters kept after backward (`set_reshard_after_backward(False)`), by `kept_key`."""


@torch.library.custom_op("fsdp2::keep_unsharded", mutates_args=())
def keep_unsharded(full: Tensor, kept_key: str) -> None:
    """Keep a copy of the gathered parameter `full` under `kept_key` for the next forward (a copy: the compiled
    graph may reuse `full`'s memory once this op has run). Side effect: writes `KEPT_UNSHARDED`."""
    KEPT_UNSHARDED[kept_key] = full.detach().clone()


@keep_unsharded.register_fake
def _(full, kept_key):
    return None


@torch.library.custom_op("fsdp2::release_unsharded", mutates_args=())
def release_unsharded(kept_key: str) -> None:
    """Drop the gathered parameter kept under `kept_key` (its forward has taken it). Side effect: writes
    `KEPT_UNSHARDED`."""
    KEPT_UNSHARDED.pop(kept_key, None)


@release_unsharded.register_fake
def _(kept_key):
    return None


@torch.library.custom_op("fsdp2::keep_alive", mutates_args=())
def keep_alive(tensors: list[Tensor]) -> None:
    """Does nothing: a use of `tensors` placed right after a collective's wait, so the generated code keeps the
    collective's input alive until the collective is done (see `passes/keep_inputs_until_wait.py`)."""


@keep_alive.register_fake
def _(tensors):
    return None


UNSHARD = torch.ops.fsdp2.unshard.default
REDUCE_GRAD = torch.ops.fsdp2.reduce_grad.default
KEEP_ALIVE = torch.fx.node.has_side_effect(torch.ops.fsdp2.keep_alive.default)
STASH_GRAD = torch.fx.node.has_side_effect(torch.ops.fsdp2.stash_grad.default)
"""Writes `_PENDING_GRADS`: marked side-effecting, so no pass or DCE drops or treats it as pure."""
ADD_PENDING_GRAD = torch.fx.node.has_side_effect(torch.ops.fsdp2.add_pending_grad.default)
"""Reads and clears `_PENDING_GRADS`: marked side-effecting like `STASH_GRAD`."""
KEEP_UNSHARDED = torch.fx.node.has_side_effect(torch.ops.fsdp2.keep_unsharded.default)
RELEASE_UNSHARDED = torch.fx.node.has_side_effect(torch.ops.fsdp2.release_unsharded.default)
DELIVER_GRAD = torch.fx.node.has_side_effect(torch.ops.fsdp2.deliver_grad.default)
RUN_ALL_REDUCE_HOOK = torch.fx.node.has_side_effect(torch.ops.fsdp2.run_all_reduce_hook.default)


class _ReadsSpec(OpArgs):
    """A view whose `spec` field is a `ParamSpec`: the spec's fields read as the view's own (`view.fqn` is
    `view.spec.fqn`), and `replace` takes them too."""

    def replace(self, **changes: Any) -> Any:
        spec = {name: changes.pop(name) for name in list(changes) if name in _SPEC_FIELDS}
        if spec:
            changes["spec"] = dataclasses.replace(changes.get("spec", self.spec), **spec)
        return dataclasses.replace(self, **changes)


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(ParamSpec))
for _name in _SPEC_FIELDS:
    setattr(_ReadsSpec, _name, property(lambda view, name=_name: getattr(view.spec, name)))

UnshardArgs = op_view(
    "UnshardArgs", UNSHARD, "Arguments of `fsdp2::unshard`: a parameter's shard and its `ParamSpec`.", base=_ReadsSpec
)
ReduceGradArgs = op_view("ReduceGradArgs", REDUCE_GRAD, "Arguments of `fsdp2::reduce_grad` (unshard's backward).")
StashGradArgs = op_view("StashGradArgs", STASH_GRAD, "Arguments of `fsdp2::stash_grad` (backward, sync off).")
AddPendingGradArgs = op_view(
    "AddPendingGradArgs",
    ADD_PENDING_GRAD,
    "Arguments of `fsdp2::add_pending_grad` (synced backward after unsynced ones).",
)
KeepAliveArgs = op_view(
    "KeepAliveArgs", KEEP_ALIVE, "Arguments of `fsdp2::keep_alive`: a wait and its collective's inputs."
)
KeepUnshardedArgs = op_view(
    "KeepUnshardedArgs", KEEP_UNSHARDED, "Arguments of `fsdp2::keep_unsharded` (backward, reshard_after_backward off)."
)
DeliverGradArgs = op_view(
    "DeliverGradArgs", DELIVER_GRAD, "Arguments of `fsdp2::deliver_grad` (backward, a parameter with hooks)."
)
RunAllReduceHookArgs = op_view(
    "RunAllReduceHookArgs", RUN_ALL_REDUCE_HOOK, "Arguments of `fsdp2::run_all_reduce_hook` (backward, a user's hook)."
)
ReleaseUnshardedArgs = op_view(
    "ReleaseUnshardedArgs",
    RELEASE_UNSHARDED,
    "Arguments of `fsdp2::release_unsharded` (a forward took a kept parameter).",
)
