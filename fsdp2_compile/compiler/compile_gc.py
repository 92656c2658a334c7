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
import threading
from collections.abc import Iterator

__all__ = ["full_collections_deferred"]

_NEVER = 2**31 - 1
_LOCK = threading.Lock()
_ACTIVE = [0, 0]
"""How many threads are inside `full_collections_deferred` now, and the third threshold before the first one
entered: the last one out restores it, so threads calling compiled modules at once leave it as it was."""


@contextlib.contextmanager
def full_collections_deferred(enabled: bool = True) -> Iterator[None]:
    """Inside, Python's full (generation-2) collections wait; once no thread is inside any more (raising or not),
    its third threshold is what it was when the first entered. Nothing when not `enabled`."""
    if not enabled:
        yield
        return
    with _LOCK:
        if _ACTIVE[0] == 0:
            _ACTIVE[1] = gc.get_threshold()[2]
            gc.set_threshold(*gc.get_threshold()[:2], _NEVER)
        _ACTIVE[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE[0] -= 1
            if _ACTIVE[0] == 0:
                gc.set_threshold(*gc.get_threshold()[:2], _ACTIVE[1])
