"""The graph contract: how the facts of a sharded parameter travel through the graph, owned in one place."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Self

import sympy
import torch
from torch import fx

from fsdp2_compile._torch_private import OpOverload, group_size, op_name
from fsdp2_compile._torch_private import functional_collectives as _funcol
from fsdp2_compile.core import grouped_unshard, ops
from fsdp2_compile.core.grouped_unshard import ReduceGroupArgs, UnshardGroupArgs
from fsdp2_compile.core.op_args import OpArgs, op_view, schema_args
from fsdp2_compile.core.ops import (
    AddPendingGradArgs,
    DeliverGradArgs,
    KeepAliveArgs,
    KeepUnshardedArgs,
    ReduceGradArgs,
    ReleaseUnshardedArgs,
    RunAllReduceHookArgs,
    StashGradArgs,
    UnshardArgs,
)

__all__ = [
    "ADD_PENDING_GRAD",
    "BUCKET",
    "COLLECTIVE_KINDS",
    "DELIVER_GRAD",
    "KEEP_ALIVE",
    "KEEP_UNSHARDED",
    "PARAMS",
    "PREFETCH",
    "REDUCE_GRAD",
    "REDUCE_GROUP",
    "RELEASE_UNSHARDED",
    "ROLE",
    "RUN_ALL_REDUCE_HOOK",
    "STASH_GRAD",
    "SubgraphCall",
    "UNSHARD",
    "UNSHARD_GROUP",
    "WAIT",
    "AddPendingGradArgs",
    "AllGatherArgs",
    "AllReduceArgs",
    "AllToAllArgs",
    "Collective",
    "CollectiveArgs",
    "DeliverGradArgs",
    "KeepAliveArgs",
    "KeepUnshardedArgs",
    "OpArgs",
    "ReduceGradArgs",
    "ReduceGroupArgs",
    "RunAllReduceHookArgs",
    "ReduceScatterArgs",
    "ReleaseUnshardedArgs",
    "Role",
    "StashGradArgs",
    "Tags",
    "UnshardArgs",
    "UnshardGroupArgs",
    "WaitArgs",
    "collective",
    "collective_kind",
    "concrete",
    "fsdp_collective_kind",
    "fsdp_op_name",
    "nbytes",
    "output_of",
    "schema_args",
    "val",
]

# ---------------------------------------------------------------------------------------------- ops

UNSHARD = ops.UNSHARD
REDUCE_GRAD = ops.REDUCE_GRAD
STASH_GRAD = ops.STASH_GRAD
ADD_PENDING_GRAD = ops.ADD_PENDING_GRAD
KEEP_ALIVE = ops.KEEP_ALIVE
KEEP_UNSHARDED = ops.KEEP_UNSHARDED
DELIVER_GRAD = ops.DELIVER_GRAD
RELEASE_UNSHARDED = ops.RELEASE_UNSHARDED
RUN_ALL_REDUCE_HOOK = ops.RUN_ALL_REDUCE_HOOK
WAIT = _funcol.wait_tensor.default
UNSHARD_GROUP = grouped_unshard.UNSHARD_GROUP
REDUCE_GROUP = grouped_unshard.REDUCE_GROUP


# ---------------------------------------------------------------------------------------------- node.meta


# A parameter's facts start as the arguments of `fsdp2::unshard` (and, in backward, `fsdp2::reduce_grad`,
# `fsdp2::stash_grad`, `fsdp2::add_pending_grad`, `fsdp2::deliver_grad`); the lowering passes turn each op into casts,
# copies and functional collectives and leave the facts in `node.meta`. This module names every step of that path:
#
# - **Named views of op arguments** (`UnshardArgs.of(node).fqn`, `ReduceGradArgs.of(node).reduce_dtype`,
#   `CollectiveArgs.of(node).group_name`, ...), one frozen dataclass per op whose fields are generated from the op's
#   schema (`op_schema(op).arguments`): no index tables. `view.as_args()` gives the positional arguments back, and
#   `view.static()` every non-tensor argument (what identifies a parameter).
# - **The `node.meta` keys** the passes leave for each other (`PARAMS`, `BUCKET`, `ROLE`) and the `Role` enum of
#   what a lowered node does; `Tags` is their typed view.
# - **The collective-kind table** (`COLLECTIVE_KINDS`), the wait op, and `collective(node)`: a collective's kind,
#   parameters, dtype and bytes.
# - **One byte counter**, `nbytes(value)`, exact for symbolic shapes (sizes evaluated at the shape environment's
#   recorded values by `concrete`). Every byte figure (schedule check, report, dump, cost model, bucketing) uses it.
#
# Nothing here rewrites graphs; passes (`passes/`) do, reading and writing through these names.
class Role(StrEnum):
    """What a node the passes inserted does (`node.meta[ROLE]`). A `StrEnum`: equal to its string value."""

    CAST = "cast"
    """Dtype conversion: to `param_dtype` before an all-gather, to `reduce_dtype` before a reduce-scatter, back
    to the parameter's dtype after it."""
    TO_DEVICE = "to_device"
    """`CPUOffloadPolicy` on an accelerator mesh: a CPU shard copied to the device before its all-gather, a reduced
    gradient copied back to the CPU."""
    PAD = "pad"
    """Zero rows appended so every rank's shard has ceil(dim0 / N) rows."""
    CONTIGUOUS = "contiguous"
    """A dense copy of a collective's input (collectives need contiguous buffers)."""
    COPY_IN = "copy_in"
    """Flattening and concatenating a bucket's members into one buffer."""
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    """HSDP: the reduced shard averaged over the replicate group."""
    ALL_REDUCE_HOOK = "all_reduce_hook"
    """The user's hook on a reduced gradient (`FSDPModule.set_all_reduce_hook`), after the collectives."""
    ALL_TO_ALL = "all_to_all"
    """A functional all-to-all (one that carries out a reduce-scatter is tagged `REDUCE_SCATTER`)."""
    LOCAL_REDUCE = "local_reduce"
    """The sum, on this rank, of the parts an all-to-all brought: the second half of a reduce-scatter."""
    WAIT = "wait"
    COPY_OUT = "copy_out"
    """Slicing a bucket's result back into its members."""
    UNPAD = "unpad"
    """The padding rows dropped again."""
    KEEP_ALIVE = "keep_alive"
    """`fsdp2::keep_alive` after a wait: the collective's inputs live until it is done."""
    TP = "tp"
    """A collective, or its wait, that tensor parallelism (DTensor redistribution) put in the graph: costed and
    checked like FSDP's, never bucketed or moved by the FSDP passes."""


PARAMS = "fsdp.params"
"""`node.meta` key: the parameter names (a tuple of fqns) a communication / cast / copy node serves; several once
bucketed."""
PREFETCH = "fsdp.prefetch"
"""`node.meta` key on an all-gather: the buckets (a tuple) whose all-gathers are issued right before this one's
first use — `FSDPModule.set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`, for the graph's
direction."""
BUCKET = "fsdp.bucket"
"""`node.meta` key: the FSDP group (module path of its `shard` call, "" = the root) a node belongs to; bucketing may
refine it."""
ROLE = "fsdp.role"
"""`node.meta` key: what a lowered node does, a `Role`."""


@dataclass(frozen=True)
class Tags:
    """The typed view of the `node.meta` facts a lowered node carries."""

    params: tuple[str, ...]
    bucket: str
    role: Role | None = None

    @classmethod
    def of(cls, node: fx.Node) -> Self | None:
        """The tags of `node`, or None when no pass tagged it."""
        if PARAMS not in node.meta and ROLE not in node.meta:
            return None
        return cls(tuple(node.meta.get(PARAMS, ())), node.meta.get(BUCKET, ""), node.meta.get(ROLE))

    def meta(self, role: Role | None = None) -> dict[str, Any]:
        """The `node.meta` entries for a node with these tags (`role` overriding this one's)."""
        return {PARAMS: self.params, BUCKET: self.bucket, ROLE: role if role is not None else self.role}


# ---------------------------------------------------------------------------------------------- bytes


UNBACKED_HINT = 8192
"""The value `concrete` gives an unbacked symbol (a size read from data, e.g. `.tolist()` of token counts under
`capture_scalar_outputs`), as inductor's `unbacked_symint_fallback`: the same on every rank, so the cost model
schedules every rank's graph alike whatever its data."""


def concrete(x: Any) -> int | float:
    """A size as a number: SymInts are evaluated with sympy at the values the shape environment recorded, unbacked
    symbols at `UNBACKED_HINT`."""
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        node = x.node
        expr = sympy.sympify(node.expr)
        values = {s: sympy.Integer(v) for s, v in node.shape_env.backed_var_to_val.items()}
        values.update({s: sympy.Integer(UNBACKED_HINT) for s in expr.free_symbols if s not in values})
        return int(expr.xreplace(values))
    return x


def nbytes(value: Any) -> int:
    """Bytes of a tensor (or the sum over a list / tuple of them; 0 for anything else), symbolic sizes evaluated
    by `concrete`. The one byte counter of the project."""
    if isinstance(value, torch.Tensor):
        return int(concrete(value.numel())) * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


def val(node: Any) -> Any:
    """The fake value of a node (`meta["val"]`), or the argument itself when it is not a node."""
    return node.meta["val"] if isinstance(node, fx.Node) else node


# ---------------------------------------------------------------------------------------------- argument views


# (the views of the fsdp2 ops are declared beside them in ops.py and grouped_unshard.py)

WaitArgs = op_view("WaitArgs", WAIT, "Arguments of `_c10d_functional::wait_tensor`.")
_FSDP_VIEWS: dict[Any, type] = {
    v.op: v
    for v in (
        UnshardArgs,
        ReduceGradArgs,
        StashGradArgs,
        AddPendingGradArgs,
        KeepAliveArgs,
        KeepUnshardedArgs,
        ReleaseUnshardedArgs,
        DeliverGradArgs,
        RunAllReduceHookArgs,
    )
}


def fsdp_op_name(node: fx.Node) -> str | None:
    """The op name ("unshard", "reduce_grad", "stash_grad", "keep_alive", ...) of a call to an fsdp2 op."""
    if node.op == "call_function" and node.target in _FSDP_VIEWS:
        return op_name(node.target)
    return None


class CollectiveArgs(OpArgs):
    """The common view of the functional collectives: every one has `input` and `group_name`;
    `CollectiveArgs.of(node)` returns the view of `node`'s own op (`AllGatherArgs`, `ReduceScatterArgs`,
    `AllReduceArgs`)."""

    kind: ClassVar[Role]

    @classmethod
    def of(cls, node: fx.Node) -> CollectiveArgs:
        if cls is CollectiveArgs:
            view = _COLLECTIVE_VIEWS.get(node.target) if node.op == "call_function" else None
            if view is None:
                raise TypeError(f"CollectiveArgs.of: node {node.name} calls {node.target}, not a functional collective")
            return view.of(node)
        return super().of(node)

    def ranks(self) -> int:
        """Ranks in the collective's group: its `group_size` argument, or (all-reduce) the group's size."""
        size = getattr(self, "group_size", None)
        if size is None:
            size = group_size(self.group_name)
        return size


AllGatherArgs = op_view(
    "AllGatherArgs", _funcol.all_gather_into_tensor.default, "Arguments of an all-gather.", base=CollectiveArgs
)
ReduceScatterArgs = op_view(
    "ReduceScatterArgs", _funcol.reduce_scatter_tensor.default, "Arguments of a reduce-scatter.", base=CollectiveArgs
)
AllReduceArgs = op_view("AllReduceArgs", _funcol.all_reduce.default, "Arguments of an all-reduce.", base=CollectiveArgs)
AllToAllArgs = op_view(
    "AllToAllArgs", _funcol.all_to_all_single.default, "Arguments of an all-to-all.", base=CollectiveArgs
)
AllGatherArgs.kind, ReduceScatterArgs.kind, AllReduceArgs.kind = Role.ALL_GATHER, Role.REDUCE_SCATTER, Role.ALL_REDUCE
AllToAllArgs.kind = Role.ALL_TO_ALL

_COLLECTIVE_VIEWS: dict[Any, type] = {v.op: v for v in (AllGatherArgs, ReduceScatterArgs, AllReduceArgs, AllToAllArgs)}

COLLECTIVE_KINDS: dict[OpOverload, Role] = {v.op: v.kind for v in _COLLECTIVE_VIEWS.values()}
"""The collective kind of each functional collective op: the one table of them."""


def collective_kind(node: fx.Node) -> Role | None:
    """ "all_gather", "reduce_scatter", "all_reduce" or "all_to_all" for a functional collective node, else None.
    An all-to-all that carries out a reduce-scatter (`passes/reduce_scatter_by_all_to_all.py`) is one."""
    kind = COLLECTIVE_KINDS.get(node.target) if node.op == "call_function" else None
    if kind == Role.ALL_TO_ALL and node.meta.get(ROLE) == Role.REDUCE_SCATTER:
        return Role.REDUCE_SCATTER
    return kind


def fsdp_collective_kind(node: fx.Node) -> Role | None:
    """The kind of a collective the FSDP passes inserted (tagged with that role); None for any other node,
    tensor parallelism's collectives included."""
    kind = collective_kind(node)
    return kind if kind is not None and node.meta.get(ROLE) == kind else None


@dataclass(frozen=True)
class Collective:
    """One collective node: its kind, the parameters it serves, and the bytes of the full (padded) tensor it
    gathers or reduces — what crosses the wire per rank, up to the (N-1)/N factor of a ring."""

    kind: Role
    params: tuple[str, ...]
    dtype: torch.dtype
    nbytes: int


INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
TAG_ACTIVATION_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


@dataclass(frozen=True)
class SubgraphCall:
    """A call of a subgraph of the graph's module: `invoke_subgraph(body, identifier, *operands)` (a block traced
    once, `block_gathers.py`) or `tag_activation_checkpoint(body, *operands)` (activation checkpointing); the
    body's placeholders take the operands in order."""

    node: fx.Node
    body: fx.Node
    """The `get_attr` node of the body."""
    identifier: str
    """invoke_subgraph's identifier ("" for activation checkpointing)."""
    operands: tuple

    @classmethod
    def of(cls, node: fx.Node) -> SubgraphCall | None:
        if node.op != "call_function":
            return None
        if node.target is INVOKE_SUBGRAPH:
            body, identifier, *operands = node.args
            return cls(node, body, identifier, tuple(operands))
        if node.target is TAG_ACTIVATION_CHECKPOINT:
            body, *operands = node.args
            return cls(node, body, "", tuple(operands))
        return None

    def module(self) -> fx.GraphModule:
        return getattr(self.node.graph.owning_module, self.body.target)

    def set_operands(self, operands: Sequence[Any]) -> None:
        """Pass `operands` instead (the body's placeholders must match them)."""
        head = (self.body, self.identifier) if self.node.target is INVOKE_SUBGRAPH else (self.body,)
        self.node.args = (*head, *operands)


def output_of(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(the multi-output node, index) when `node` is `getitem(that node, index)`, else None."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    source, index = node.args
    return source, index


def collective(node: fx.Node) -> Collective | None:
    """The collective `node` issues, or None when it is not a collective."""
    kind = collective_kind(node)
    if kind is None:
        return None
    full = val(node) if kind == Role.ALL_GATHER else val(CollectiveArgs.of(node).input)
    return Collective(kind, node.meta.get(PARAMS, ()), full.dtype, nbytes(full))
