"""What a pass is: a function `(gm, ctx: PassContext) -> gm` with a declared contract.

A pass declares the facts about the graph it needs (`requires`) and the ones it establishes (`provides`) with
`@contract(...)`; `check_contracts(passes)` (run by `pass_list.run_pipeline` before any pass) refuses a list in
which a pass comes before what it requires, naming the pass, the missing fact and who provides it. A function
without a declared contract requires and provides nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from torch import fx

from fsdp2_compile.compiler.cost_model import Timeline
from fsdp2_compile.compiler.graph_records import Snapshot
from fsdp2_compile.config import CompileConfig
from fsdp2_compile.core.hardware import PROFILES, HardwareProfile

__all__ = ["Fact", "Pass", "PassContext", "PassOrderError", "check_contracts", "contract", "provides", "requires"]


class Fact(StrEnum):
    """What a pass can establish about the graph it leaves."""

    TP_TAGGED = "tp_tagged"
    """Collectives already in the captured graph (tensor parallelism's) and their waits carry `Role.TP`."""
    COLLECTIVES_OF_ONE_DROPPED = "collectives_of_one_dropped"
    """No collective over a process group of one rank is left of those the captured graph held."""
    TIED_GRADS_COMBINED = "tied_grads_combined"
    """A parameter used several times has one `fsdp2::reduce_grad` (its gradients summed before reduction)."""
    UNSHARD_LOWERED = "unshard_lowered"
    """No `fsdp2::unshard` left: cast / pad / all-gather / wait / unpad nodes tagged with `ir.Tags`."""
    REDUCE_GRAD_LOWERED = "reduce_grad_lowered"
    """No `fsdp2::reduce_grad` left: cast / pad / reduce-scatter / wait [/ all-reduce / wait] nodes, tagged."""
    BUCKETED = "bucketed"
    """Collectives fused per bucket (`CompileConfig.buckets`)."""
    PREFETCHED = "prefetched"
    """A structural overlap order: all-gathers started ahead of use, waits right before first use."""
    ORDERED = "ordered"
    """The final order is chosen (`ctx.timeline` holds its simulated step); later passes must not move nodes."""
    COLLECTIVES_SAFE = "collectives_safe"
    """Every collective's inputs are used at or after its wait (`invariants.check_collectives_safe` holds)."""


@dataclass
class PassContext:
    """What a pass may know besides the graph."""

    kind: str
    """Which graph this is: "forward", "backward" or "inference"."""
    config: CompileConfig = field(default_factory=CompileConfig)
    profile: HardwareProfile = PROFILES["cpu-gloo-loopback"]
    """The cost model's hardware figures (the backend passes the agreed measured or named profile)."""
    timeline: Timeline | None = None
    """The simulated step of the final order, left by `schedule`."""
    keep_snapshots: bool = False
    """Keep the graph after every pass in `snapshots` (also when `config.keep_snapshots` or $FSDP2_COMPILE_DUMP)."""
    snapshots: list[Snapshot] = field(default_factory=list)
    """The graph after every pass, for dumps (empty unless snapshots are kept)."""
    param_order: dict[str, int] = field(default_factory=dict)
    """Each parameter's place in the order `shard` took them (FSDP2's order within a group), by fqn; empty when
    unknown (graph order stands)."""


Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


def contract(*, requires: Iterable[Fact] = (), provides: Iterable[Fact] = ()) -> Callable[[Pass], Pass]:
    """Declare what a pass needs before it and what it establishes (sets `requires` / `provides` on the function)."""

    def declare(p: Pass) -> Pass:
        p.requires = frozenset(requires)
        p.provides = frozenset(provides)
        return p

    return declare


def requires(p: Pass) -> frozenset[Fact]:
    return getattr(p, "requires", frozenset())


def provides(p: Pass) -> frozenset[Fact]:
    return getattr(p, "provides", frozenset())


class PassOrderError(ValueError):
    """A pass list in which a pass runs before a fact it requires is established."""


def _name(p: Pass) -> str:
    return getattr(p, "__name__", repr(p))


def check_contracts(passes: Sequence[Pass]) -> None:
    """Raise PassOrderError naming the first pass whose `requires` no earlier pass `provides`, and the passes
    that provide it."""
    have: set[Fact] = set()
    for i, p in enumerate(passes):
        missing = sorted(requires(p) - have)
        if missing:
            where = "; ".join(
                f"'{fact}' is provided by {', '.join(_name(q) for q in passes if fact in provides(q)) or 'no pass in the list'}"
                for fact in missing
            )
            raise PassOrderError(
                f"fsdp2_compile: pass #{i} {_name(p)} requires {', '.join(repr(str(f)) for f in missing)}, which no "
                f"earlier pass provides ({where}); order the list so that {_name(p)} runs after them"
            )
        have |= provides(p)
