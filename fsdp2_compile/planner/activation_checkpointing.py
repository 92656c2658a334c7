"""Activation checkpointing as the planner applies it to each block of the model's block list.

- "none": autograd saves what each op's backward needs.
- "full": `checkpoint_wrapper` per block: only the block's input is kept; the block's forward runs again in
  backward.
- "selective": torchtitan's per-op policy (`torchtitan/parallelisms/parallelize_llama.py` at commit 9dec370, the
  version of its Dec 2024 H100 benchmark): save the outputs of mm (except every second mm of a block), flash and
  memory-efficient attention, reduce-scatter, abs and max; recompute everything else.
A model whose factory already wrapped modules in `checkpoint_wrapper` is planned as it is ("as given").
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdp2_compile._torch_private import (
    CheckpointWrapper,
    checkpoint_wrapped_module,
    checkpoint_wrapper,
    efficient_attention,
    flash_attention,
    functional_collectives,
)
from fsdp2_compile.planner.reduced_depth import block_list

__all__ = ["AC_MODES", "SELECTIVE_SAVE_OPS", "apply_ac", "has_checkpointing", "unwrap_checkpointing"]

AC_MODES = ("none", "full", "selective")

_aten = torch.ops.aten
SELECTIVE_SAVE_OPS = {
    _aten.mm.default,
    efficient_attention.default,
    flash_attention.default,
    functional_collectives.reduce_scatter_tensor.default,
    _aten.abs.default,
    _aten.max.default,
}
"""torchtitan's `_save_list` (commit 9dec370, 2024-12-26)."""


def has_checkpointing(model: nn.Module) -> bool:
    return any(isinstance(m, CheckpointWrapper) for m in model.modules())


def _selective_context():
    counts = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func == _aten.mm.default:
            counts[key] += 1
        save = func in SELECTIVE_SAVE_OPS and not (func == _aten.mm.default and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _Both:
    """Enter two context managers as one."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __enter__(self):
        self.first.__enter__()
        self.second.__enter__()

    def __exit__(self, *exc):
        self.second.__exit__(*exc)
        self.first.__exit__(*exc)


def _context_fn(inner, recompute_context):
    """A checkpoint `context_fn`: `inner`'s contexts (or none), with `recompute_context()` also entered around the
    recomputation (the planner's attention mode, which backward does not inherit)."""
    if recompute_context is None:
        return inner
    from contextlib import nullcontext

    def fn():
        forward, recompute = inner() if inner is not None else (nullcontext(), nullcontext())
        return forward, _Both(recompute, recompute_context())

    return fn


def apply_ac(model: nn.Module, mode: str, recompute_context=None) -> int:
    """Wrap each block of the model's block list for `mode` ("as given": re-wrap the model's own
    `checkpoint_wrapper`s with the same settings); returns the number of modules wrapped."""
    if mode == "as given":
        count = 0
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, CheckpointWrapper):
                    kwargs = dict(getattr(child.checkpoint_fn, "keywords", {}))
                    kwargs.pop("use_reentrant", None)
                    kwargs["context_fn"] = _context_fn(kwargs.get("context_fn"), recompute_context)
                    setattr(module, name, checkpoint_wrapper(checkpoint_wrapped_module(child), **kwargs))
                    count += 1
        return count
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {AC_MODES}")
    _, blocks = block_list(model)
    if mode == "none" or blocks is None:
        return 0
    inner = _selective_context if mode == "selective" else None
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(
            block, preserve_rng_state=False, context_fn=_context_fn(inner, recompute_context) or _no_context
        )
    return len(blocks)


def _no_context():
    from contextlib import nullcontext

    return nullcontext(), nullcontext()


def unwrap_checkpointing(model: nn.Module) -> None:
    """Replace every `CheckpointWrapper` by the module it wraps (the planner's compiled copies: checkpointing
    changes no collective)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, CheckpointWrapper):
                setattr(module, child_name, checkpoint_wrapped_module(child))
