"""What a run of `fsdp2-compile` costs this process as --world-size grows (the fake process group keeps per-rank
state): the figures in data/cli_footprint.json, the estimate and the warning they give, and the peak RSS."""

from __future__ import annotations

import json
import sys
from importlib import resources

__all__ = ["BASE_BYTES", "BYTES_PER_RANK", "LARGE_WORLD", "memory_estimate", "peak_rss_bytes", "warn_if_large"]

LARGE_WORLD = 100_000
"""--world-size above this warns with the memory and time the fake process group's run will need."""

_FIGURES = json.loads(resources.files("fsdp2_compile").joinpath("data/cli_footprint.json").read_text())
BASE_BYTES: int = _FIGURES["base_bytes"]
"""Peak RSS of `dump` / `plan` at a small --world-size (torch, the compiler, a small model)."""
BYTES_PER_RANK: int = _FIGURES["bytes_per_rank"]
"""Peak RSS per rank of --world-size."""
SECONDS_PER_MILLION_RANKS: float = _FIGURES["seconds_per_million_ranks"]
"""Extra run time per million ranks."""


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux: ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_estimate(world_size: int) -> int:
    """Rough peak RSS of a run at `world_size` ranks (BASE_BYTES + BYTES_PER_RANK x N; a large model adds its own)."""
    return BASE_BYTES + BYTES_PER_RANK * world_size


def warn_if_large(prog: str, world_size: int) -> None:
    """Above LARGE_WORLD ranks, say on stderr how much memory and time the run will need."""
    if world_size <= LARGE_WORLD:
        return
    from fsdp2_compile.debug.sizes import size_text

    seconds = SECONDS_PER_MILLION_RANKS * world_size / 1e6
    print(
        f"{prog}: warning: --world-size {world_size:,} is simulated in this one process (the fake process "
        f"group keeps per-rank state): expect about {size_text(memory_estimate(world_size))} of memory "
        f"(measured: {size_text(BYTES_PER_RANK)} per rank plus {size_text(BASE_BYTES)}, more for a large "
        f"model) and about {seconds:.0f} s more run time",
        file=sys.stderr,
        flush=True,
    )
