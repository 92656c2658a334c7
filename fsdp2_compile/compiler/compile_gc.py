"""Full garbage collections deferred while the fsdp2 backend compiles (`CompileConfig.defer_full_gc`).

Compiling makes millions of short-lived Python objects (Dynamo's variable trackers, fake tensors, fx nodes). Python
starts a young collection every ~700 allocations and, every tenth of those, may start a full one, which walks every
object in the process, torch's own modules included. Inside `full_collections_deferred` full collections wait (young
ones still run, and free what dies young); on leaving it, the thresholds are as they were, and the first full
collection after it frees what the compile left. Entered around a `shard_compile`d module's call (Dynamo's tracing
and guards, the backend) and around the backend's own compiles (`torch.compile(model, backend="fsdp2")`, and the
backward graph AOTAutograd compiles lazily at the first backward); other compiles in the process are untouched.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["full_collections_deferred"]

_NEVER = 2**31 - 1


@contextlib.contextmanager
def full_collections_deferred(enabled: bool = True) -> Iterator[None]:
    """Inside, Python's full (generation-2) collections wait; afterwards (raising or not) its third threshold is
    what it was on entry. Nothing when not `enabled`."""
    if not enabled:
        yield
        return
    _, _, saved = gc.get_threshold()
    gc.set_threshold(*gc.get_threshold()[:2], _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*gc.get_threshold()[:2], saved)
