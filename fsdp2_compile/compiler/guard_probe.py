"""Dynamo's guard-latency probe skipped for the frames the fsdp2 backend compiles.

After compiling a frame, torch 2.13's Dynamo times its guards once, for a debug log and a compile metric, and first
flushes the CPU cache by writing a 32 MiB buffer: every process that compiles once peaks 32 MiB higher than it
otherwise would (a 2-layer Llama on 2 ranks: 392 MiB per rank, 363 MiB after that compile, against 314 MiB for
`fully_shard`). For the frames the fsdp2 backend compiled, that timing is skipped (Dynamo logs a latency of 0);
their guards are built and checked as before, and other backends' frames are timed as they were. Installed once,
when the fsdp2 backend is imported (`backend.py`).
"""

from __future__ import annotations

import threading

from fsdp2_compile._torch_private import current_compile_id, skip_guard_latency_probe

__all__ = ["compiled_by_fsdp2", "skip_probe_for_fsdp2_frames"]

_FRAMES: set[tuple[int, int]] = set()
_installed = threading.Lock()


def compiled_by_fsdp2() -> None:
    """Mark the Dynamo compile in progress as the fsdp2 backend's (its guards are built after the backend returns)."""
    compile_id = current_compile_id()
    if compile_id is not None:
        _FRAMES.add(compile_id)


def _marked() -> bool:
    compile_id = current_compile_id()
    if compile_id in _FRAMES:
        _FRAMES.discard(compile_id)
        return True
    return False


def skip_probe_for_fsdp2_frames() -> None:
    """Install the skip for every later compile in this process (once; later calls do nothing)."""
    if _installed.acquire(blocking=False):
        skip_guard_latency_probe(_marked)
