"""Attention as the planner assumes it runs.

"fused": `F.scaled_dot_product_attention` runs as flash attention (memory-efficient attention when it has a mask),
as PyTorch picks on a GPU: backward keeps only the output and the log-sum-exp, and FLOPs follow the causal mask.
"math": the unfused decomposition (scores, softmax, both saved for backward), which is what the meta device and
an old CPU build run.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fsdp2_compile._torch_private import efficient_attention, flash_attention, op_schema

__all__ = ["ATTENTION_MODES", "AttentionMode", "is_attention", "is_causal"]

ATTENTION_MODES = ("fused", "math")


def _fused(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    if attn_mask is not None:
        return efficient_attention(q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
    return flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]


class AttentionMode(TorchFunctionMode):
    """Runs `F.scaled_dot_product_attention` as the fused kernel ("fused") or leaves it as traced ("math")."""

    def __init__(self, mode: str):
        super().__init__()
        if mode not in ATTENTION_MODES:
            raise ValueError(f"attention {mode!r} is not one of {ATTENTION_MODES}")
        self.mode = mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.mode == "fused":
            return _fused(*args, **kwargs)
        return func(*args, **kwargs)


def is_attention(func) -> bool:
    """A fused attention kernel (forward or backward)."""
    return "scaled_dot_product" in func.__name__


def is_causal(func, args, kwargs) -> bool:
    """The op's `is_causal` argument, read through its schema (False if it has none)."""
    for i, a in enumerate(op_schema(func).arguments):
        if a.name == "is_causal":
            return bool(kwargs.get("is_causal", args[i] if i < len(args) else False))
    return False
