"""Bytes of a model's parameters, gradients and AdamW state per rank: analytical (numel x bytes / N) and counted on a
sharded model's local tensors, and the gathered sizes of its buckets.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2_compile.core.ir import nbytes

__all__ = ["analytical_bytes", "sharded_bytes"]

ADAMW_STATES = 2
"""AdamW keeps exp_avg and exp_avg_sq per parameter element (fp32 here)."""


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    seen, params = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def analytical_bytes(model: nn.Module, world_size: int, tp: int = 1) -> dict[str, float]:
    """numel x bytes / N for parameters and gradients, 2 x 4 bytes x numel / N for AdamW (unsharded model); N is
    the number of ranks a parameter is sharded over (HSDP: the shard size), times `tp` for a parameter tensor
    parallelism shards (a DTensor with a Shard placement, after the TP plan)."""

    def ranks(p) -> int:
        return world_size * tp if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements) else world_size

    params = sum(nbytes(p) / ranks(p) for p in _unique_params(model))
    grads = sum(nbytes(p) / ranks(p) for p in _unique_params(model) if p.requires_grad)
    optim = sum(ADAMW_STATES * 4 * p.numel() / ranks(p) for p in _unique_params(model) if p.requires_grad)
    return {"params": params, "grads": grads, "optimizer": optim}


def sharded_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and AdamW state, counted on the sharded model's local tensors."""
    local = [(p, p.to_local() if isinstance(p, DTensor) else p) for p in _unique_params(model)]
    return {
        "params": sum(nbytes(t) for _, t in local),
        "grads": sum(nbytes(t) for p, t in local if p.requires_grad),
        "optimizer": sum(ADAMW_STATES * 4 * t.numel() for p, t in local if p.requires_grad),
    }


def _resharded_sizes(model: nn.Module, itemsize: int) -> dict[str, int]:
    """Gathered bytes of each bucket resharded after forward (unpadded, as selective unsharding counts them), in
    the order of last use in forward: the blocks in order, then the root (whose head comes last)."""
    from fsdp2_compile.runtime.sharding import managed_params

    sizes: dict[str, int] = {}
    for _, p, info in managed_params(model):
        if info.reshard_after_forward:
            sizes[info.bucket] = sizes.get(info.bucket, 0) + math.prod(p.shape) * itemsize
    return {b: sizes[b] for b in sorted(sizes, key=lambda b: b == "")}


def _bucket_numel(model: nn.Module) -> dict[str, int]:
    """Full padded elements each bucket (`shard` call) gathers, in bucket order (blocks, then the root)."""
    from fsdp2_compile.core.ops import padded_rows
    from fsdp2_compile.runtime.sharding import managed_params

    buckets: dict[str, int] = {}
    for _, p, info in managed_params(model):
        rows = padded_rows(info.dim0, info.world_size) * info.world_size
        local = p.to_local() if isinstance(p, DTensor) else p  # trailing dims: TP-local under tensor parallelism
        buckets[info.bucket] = buckets.get(info.bucket, 0) + rows * math.prod(local.shape[1:])
    return buckets


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _analytical_by_name(model: nn.Module, world_size: int, tp: int) -> dict[str, dict[str, float]]:
    """`analytical_bytes`' figures of each parameter, by name (before sharding)."""
    out = {}
    for name, p in model.named_parameters():
        ranks = world_size * tp if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements) else world_size
        grad = p.requires_grad
        out[name] = {
            "params": nbytes(p) / ranks,
            "grads": nbytes(p) / ranks if grad else 0.0,
            "optimizer": ADAMW_STATES * 4 * p.numel() / ranks if grad else 0.0,
        }
    return out
