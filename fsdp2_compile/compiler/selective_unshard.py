"""Selective unsharding (`CompileConfig.keep_gathered`, or what `CompileConfig.memory_budget_bytes` leaves beyond
the prefetch window): which buckets keep their gathered parameters from forward to backward instead of resharding
after forward and gathering again in backward.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from torch import fx

from fsdp2_compile.core.fx_edit import nodes_calling
from fsdp2_compile.core.ir import UNSHARD, UnshardArgs, nbytes, val

__all__ = ["KEPT_META", "KeptGathered", "buckets_to_keep", "choose_kept", "keep_amount"]

log = logging.getLogger("fsdp2_compile")

KEPT_META = "fsdp2_kept_gathered"
"""Key of a partitioned graph's `GraphModule.meta` holding its `KeptGathered` decision."""


# The compiler sees the whole step, so it can spend a memory budget where hooks cannot: every kept byte saves one
# gathered byte in backward, so buckets pay alike per byte; the last buckets of the forward go first, because
# backward needs them first, and their re-gather is the one backward cannot hide behind earlier compute. Buckets are
# taken whole, last to first, while they fit the budget. Decisions depend on the graph and the config only (the same
# on every rank). Buckets that `reshard_after_forward=False` keeps already are not counted. The decision travels with
# the forward and backward graphs (`KEPT_META` in their `meta`, then `GraphRecord.kept_gathered`), so the dump shows
# it; the planner makes the same decision from the full model's bucket sizes (`choose_kept`).
@dataclass(frozen=True)
class KeptGathered:
    """What selective unsharding decided: the buckets kept gathered for backward (the one backward needs first,
    first), their gathered bytes, the gathered bytes of every resharded bucket, and the budget. (Backward saves
    what it would have gathered again: the parameters it reads, at most these bytes.)"""

    buckets: tuple[str, ...]
    kept_bytes: int
    resharded_bytes: int
    budget: int

    def summary(self, size: Callable[[int], str] = lambda n: f"{n:,} bytes") -> str:
        """The decision in words (the dump's, the log's and the plan's line begins with it)."""
        names = ", ".join(b or "<root>" for b in self.buckets) or "nothing"
        return (
            f"selective unsharding: kept gathered for backward: {names} ({size(self.kept_bytes)} gathered of "
            f"{size(self.resharded_bytes)} resharded, budget {size(self.budget)})"
        )

    def describe(self, size: Callable[[int], str] = lambda n: f"{n:,} bytes") -> str:
        return f"{self.summary(size)}: backward does not gather them again"


def choose_kept(sizes: dict[str, int], keep: int | float) -> KeptGathered:
    """Buckets kept for `keep` bytes (an int) or that fraction of all `sizes` (a float): `sizes` maps each
    resharded bucket to its gathered bytes, in the order of its last use in forward."""
    total = sum(sizes.values())
    budget = int(keep * total) if isinstance(keep, float) else keep
    kept, used = [], 0
    for bucket in reversed(sizes):  # what backward needs first goes first
        if used + sizes[bucket] <= budget:
            kept.append(bucket)
            used += sizes[bucket]
    return KeptGathered(tuple(kept), used, total, budget)


def keep_amount(config, largest_bucket: int) -> int | float | None:
    """What selective unsharding may keep: `config.keep_gathered` when set; else, under
    `config.memory_budget_bytes` (the gathered bytes allowed alive at once), what the budget leaves beyond the
    prefetch window of `prefetch_depth + 1` buckets of `largest_bucket` bytes (0 when it leaves nothing); else None
    (FSDP2's behaviour)."""
    if config.keep_gathered is not None or config.memory_budget_bytes is None:
        return config.keep_gathered
    return max(0, config.memory_budget_bytes - (config.prefetch_depth + 1) * largest_bucket)


def buckets_to_keep(joint: fx.Graph, config) -> KeptGathered | None:
    """The decision for the joint graph `joint` under `config` (`keep_amount`: bytes, or a fraction of the
    resharded buckets' gathered bytes); None when nothing asks for selective unsharding."""
    sizes: dict[str, int] = {}
    every: dict[str, int] = {}  # every bucket's gathered bytes, resharded or not: any may be in the prefetch window
    last_use: dict[str, int] = {}
    seen: set[str] = set()
    smallest_param = 0
    for i, node in enumerate(nodes_calling(joint, UNSHARD)):
        call = UnshardArgs.of(node)
        if call.fqn not in seen:
            seen.add(call.fqn)
            size = nbytes(val(node))
            every[call.bucket] = every.get(call.bucket, 0) + size
            smallest_param = min(smallest_param, size) if smallest_param else size
        if call.reshard_after_forward:
            last_use[call.bucket] = i
            sizes[call.bucket] = every[call.bucket]
    keep = keep_amount(config, max(every.values(), default=0))
    if keep is None:
        return None
    _warn_if_nothing_fits(config, every, sizes, smallest_param)
    decision = choose_kept({b: sizes[b] for b in sorted(sizes, key=last_use.__getitem__)}, keep)
    log.info("%s", decision.describe())
    return decision


def _warn_if_nothing_fits(config, every: dict[str, int], resharded: dict[str, int], smallest_param: int) -> None:
    """Warn when a budget in bytes holds no bucket: `memory_budget_bytes` below the smallest gather (a bucket of
    `every` with `buckets="shard_calls"`, else one parameter: no bucketing gathers less), which neither prefetching
    nor keeping can honour; a `keep_gathered` byte count below the smallest `resharded` bucket, which keeps nothing.
    The graph and the config decide it, so every rank warns alike."""
    budget = config.memory_budget_bytes
    if budget is not None and every:
        name, size = (
            min(every.items(), key=lambda kv: kv[1]) if config.buckets == "shard_calls" else (None, smallest_param)
        )
        if budget < size:
            effect = "nothing is prefetched or kept gathered, and every all-gather exceeds it"
            _warn("memory_budget_bytes", budget, name, size, effect, ", or CompileConfig.buckets=<bytes>")
            return
    keep = config.keep_gathered
    if isinstance(keep, int) and keep and resharded:
        name, size = min(resharded.items(), key=lambda kv: kv[1])
        if keep < size:
            _warn("keep_gathered", keep, name, size, "no bucket is kept gathered for backward", "")


def _warn(field: str, budget: int, bucket: str | None, size: int, effect: str, more_fixes: str) -> None:
    what = "the smallest gather (one parameter" if bucket is None else f"the smallest bucket ('{bucket or '<root>'}'"
    warnings.warn(
        f"CompileConfig.{field}={budget:,} bytes is smaller than {what}: {size:,} bytes gathered), so {effect}. "
        f"Raise {field} to at least {size:,}, make buckets smaller (shard smaller modules{more_fixes}), or drop "
        f"{field}",
        stacklevel=3,
    )
