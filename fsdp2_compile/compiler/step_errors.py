"""What an error raised by torch inside a compiled step gets added: the module, the inputs it was called with
and how to see the failing line of the user's code. Torch's own message stays as it is."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from fsdp2_compile.runtime.param_state import is_sharded, state_of

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOTED = "_fsdp2_noted"


def note_step_error(error: BaseException, module: nn.Module, leaves: list[tuple[str, Any]]) -> None:
    """Add a note to `error` (raised calling the compiled `module` with `leaves`, (path, value) pairs) unless it is
    one of this package's own errors, which name their cause already, or was noted before."""
    if getattr(error, _NOTED, False) or not isinstance(error, Exception) or _raised_here(error):
        return
    setattr(error, _NOTED, True)
    tensors = [(name, v) for name, v in leaves if isinstance(v, torch.Tensor)]
    shown = ", ".join(f"{name} {_dtype(v.dtype)} {tuple(v.shape)}" for name, v in tensors[:6]) or "no tensors"
    lines = [f"fsdp2_compile: raised in the compiled step of {type(module).__name__}, called with {shown}."]
    compute = _compute_dtype(module)
    odd = [name for name, v in tensors if v.is_floating_point() and v.dtype != compute]
    if compute is not None and odd and not _casts_inputs(module):
        lines.append(
            f"{', '.join(odd)} {'is' if len(odd) == 1 else 'are'} not {_dtype(compute)}, the dtype the parameters "
            "compute in: cast the input, or keep MixedPrecisionPolicy(cast_forward_inputs=True)."
        )
    buffers = _buffers_of_another_dtype(module, compute)
    if buffers:
        lines.append(
            f"Buffer {', '.join(repr(b) for b in buffers)} {'is' if len(buffers) == 1 else 'are'} not "
            f"{_dtype(compute)}: MixedPrecisionPolicy casts parameters, not buffers; pass "
            f"MixedPrecisionPolicy(buffer_dtype={compute}) to shard, or cast it in forward."
        )
    lines.append(
        'To see the line of your model that raised it, run the step under torch.compiler.set_stance("force_eager") '
        "(the same sharded model, uncompiled)."
    )
    error.add_note(" ".join(lines))


def _raised_here(error: BaseException) -> bool:
    """Whether the innermost Python frame of `error`'s traceback is this package's own code (a tensor subclass's
    `__torch_function__` / `__torch_dispatch__` only passes torch's errors on)."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return code.co_filename.startswith(_PACKAGE) and not code.co_name.startswith("__torch_")


def _casts_inputs(module: nn.Module) -> bool:
    """Whether the module's policy casts its floating inputs to `param_dtype` (then they are not the cause)."""
    mp = state_of(module).mp_policy if is_sharded(module) else None
    return mp is not None and mp.param_dtype is not None and mp.cast_forward_inputs


def _buffers_of_another_dtype(module: nn.Module, compute: torch.dtype | None) -> list[str]:
    """Under a policy's `param_dtype` (and no `buffer_dtype`), the floating buffers of another dtype (first 3)."""
    if not is_sharded(module) or compute is None or state_of(module).mp_policy.param_dtype is None:
        return []
    if state_of(module).mp_policy.buffer_dtype is not None:
        return []
    odd = [n for n, b in module.named_buffers() if b.is_floating_point() and not b.is_complex() and b.dtype != compute]
    return odd[:3]


def _compute_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype the module's parameters compute in: the policy's `param_dtype`, else the parameters' own."""
    if is_sharded(module) and state_of(module).mp_policy.param_dtype is not None:
        return state_of(module).mp_policy.param_dtype
    param = next(iter(module.parameters()), None)
    return None if param is None else param.dtype


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
