"""Selective unsharding (`CompileConfig.keep_gathered`): which buckets keep their gathered parameters from forward
to backward instead of resharding after forward and gathering again in backward.

The compiler sees the whole step, so it can spend a memory budget where hooks cannot: every kept byte saves one
gathered byte in backward, so buckets pay alike per byte; the last buckets of the forward go first, because
backward needs them first, and their re-gather is the one backward cannot hide behind earlier compute. Buckets are
taken whole, last to first, while they fit the budget. Decisions depend on the graph and the config only (the same
on every rank). Buckets that `reshard_after_forward=False` keeps already are not counted.
"""

from __future__ import annotations

import logging

from torch import fx

from .graph import nodes_calling
from .ir import UNSHARD, UnshardArgs, nbytes, val

__all__ = ["buckets_to_keep"]

log = logging.getLogger("fsdp2_compile")


def buckets_to_keep(joint: fx.Graph, keep: int | float | None) -> set[str]:
    """The buckets whose gathered parameters stay alive for backward: `keep` bytes (an int), or that fraction of
    the resharded buckets' gathered bytes (a float); none for None."""
    if keep is None:
        return set()
    sizes: dict[str, int] = {}
    last_use: dict[str, int] = {}
    seen: set[str] = set()
    for i, node in enumerate(nodes_calling(joint, UNSHARD)):
        call = UnshardArgs.of(node)
        if not call.reshard_after_forward:
            continue
        last_use[call.bucket] = i
        if call.fqn not in seen:
            seen.add(call.fqn)
            sizes[call.bucket] = sizes.get(call.bucket, 0) + nbytes(val(node))
    budget = int(keep * sum(sizes.values())) if isinstance(keep, float) else keep
    kept, used = [], 0
    for bucket in sorted(sizes, key=last_use.__getitem__, reverse=True):  # what backward needs first goes first
        if used + sizes[bucket] <= budget:
            kept.append(bucket)
            used += sizes[bucket]
    log.info("selective unsharding: keeping %s gathered for backward (%d of %d bytes, budget %d): backward "
             "gathers %d bytes less", kept or "nothing", used, sum(sizes.values()), budget, used)
    return set(kept)
