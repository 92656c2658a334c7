"""Handing the C heap's free pages back to the OS.

glibc raises its mmap threshold to the size of the largest mmapped block freed (up to 32 MiB), so after a few large
temporary tensors are freed, later ones of that size come from the heap, and what the heap frees stays resident.
`release_freed_heap` (glibc's `malloc_trim(0)`) returns those pages; a no-op without glibc.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

__all__ = ["release_freed_heap"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def release_freed_heap() -> None:
    """Return the C heap's free pages to the OS (glibc's `malloc_trim(0)`)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
