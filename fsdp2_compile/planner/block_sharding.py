"""FSDP2's pattern as the planner, the CLI and recipes apply it: `shard` each block of the model's longest
ModuleList, then the root.
"""

from __future__ import annotations

from torch import nn

from fsdp2_compile.planner.reduced_depth import block_list

__all__ = ["shard_blocks", "shard_for_plan"]


def shard_blocks(model: nn.Module, mesh=None, **shard_kwargs) -> None:
    """`shard` each block of the model's longest ModuleList (FSDP2's pattern, before the root; the CLI's and the
    planner's convention)."""
    from fsdp2_compile.runtime.sharding import shard

    _, blocks = block_list(model)
    for block in blocks if blocks is not None else ():
        shard(block, mesh, **shard_kwargs)


def shard_for_plan(model: nn.Module, blocks: bool = True, **shard_kwargs) -> nn.Module:
    """FSDP2's pattern: `shard` each block of the longest ModuleList (unless `blocks` is False), then the root."""
    from fsdp2_compile.runtime.sharding import shard

    if blocks:
        shard_blocks(model, **shard_kwargs)
    return shard(model, **shard_kwargs)
