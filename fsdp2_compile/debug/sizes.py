"""Byte counts as people read them: the one formatter the dump, the graph views, the planner and the CLI share."""

from __future__ import annotations

__all__ = ["size_text", "unit_of"]

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def unit_of(n: float) -> tuple[str, int]:
    """(unit name, bytes per unit) of the largest unit `n` bytes fill at least once."""
    return next(((u, k) for u, k in _UNITS if abs(n) >= k), ("B", 1))


def size_text(n: float) -> str:
    """Bytes in the unit that fits: '512 B', '3.25 KiB', '1.50 MiB', '2.00 GiB', '1.25 TiB'."""
    unit, scale = unit_of(n)
    return f"{n:,.0f} B" if scale == 1 else f"{n / scale:,.2f} {unit}"
