"""Full garbage collections deferred while torch compiles.

Compiling makes millions of short-lived Python objects (Dynamo's variable trackers, fake tensors, fx nodes). Python
starts a young collection every ~700 allocations and, every tenth of those, may start a full one, which walks every
object in the process, torch's own modules included: 0.25-0.5 s each, five of them (1.8 s) in the first step of a
32-layer GPT, more the larger the heap. While torch compiles, full collections wait for the compile's end (young
ones still run, and free what dies young); the first full collection after it frees what the compile left.
Installed once, when the fsdp2 backend is imported (`backend.py`).
"""

from __future__ import annotations

import gc
import threading

from fsdp2_compile._torch_private import on_every_compile

__all__ = ["defer_full_collections_while_compiling"]

_NEVER = 2**31 - 1
_saved: list[int] = []
_installed = threading.Lock()


def _defer() -> None:
    t0, t1, t2 = gc.get_threshold()
    _saved.append(t2)
    gc.set_threshold(t0, t1, _NEVER)


def _resume() -> None:
    if _saved:
        t0, t1, _ = gc.get_threshold()
        gc.set_threshold(t0, t1, _saved.pop())


def defer_full_collections_while_compiling() -> None:
    """Install the deferral for every later compile in this process (once; later calls do nothing)."""
    if _installed.acquire(blocking=False):
        on_every_compile(_defer, _resume)
