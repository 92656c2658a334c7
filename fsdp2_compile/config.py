"""User-facing configuration objects (frozen dataclasses, FSDP2 names where the meaning is the same)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "CompileConfig"]


def _check_floating(name: str, dtype: torch.dtype | None) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"MixedPrecisionPolicy.{name}={dtype!r} is not a floating-point dtype; "
            "use e.g. torch.bfloat16, torch.float16 or torch.float32, or None to keep the parameter's dtype"
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes to compute and communicate in, with FSDP2's meaning."""

    param_dtype: torch.dtype | None = None
    """Dtype parameters are cast to *before* the all-gather and computed in; None keeps the stored dtype."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are reduce-scattered in; None means `param_dtype` (or the stored dtype if that is None)."""
    output_dtype: torch.dtype | None = None
    """Dtype floating-point forward outputs of the sharded module are cast to; None leaves them as they are."""
    cast_forward_inputs: bool = True
    """Cast floating-point forward inputs of the sharded module to `param_dtype`."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_floating(name, getattr(self, name))


@dataclass(frozen=True)
class CompileConfig:
    """How the backend turns captured graphs into executable sharded graphs."""

    compiler: str = "aot_eager"
    """What runs the final graphs: "aot_eager" (the FX graphs as they are)."""

    def __post_init__(self) -> None:
        if self.compiler not in ("aot_eager",):
            raise ValueError(f"CompileConfig.compiler={self.compiler!r} is not one of: 'aot_eager'")
