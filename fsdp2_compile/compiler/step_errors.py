"""What an error raised by torch inside a compiled step gets added: the module, the inputs it was called with
and how to see the failing line of the user's code. Torch's own message stays as it is."""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch import nn

from fsdp2_compile.compiler.rank_consistency import PeerCompileFailed
from fsdp2_compile.config import MixedPrecisionPolicy
from fsdp2_compile.runtime.param_state import is_sharded, state_of

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOTED = "_fsdp2_noted"


_SAME_INPUTS = (
    "every rank must call the model with inputs of the same shapes and dtypes (or with dims marked dynamic that "
    "trace alike on every rank)"
)


def shown_inputs(leaves: list[tuple[str, Any]]) -> str:
    """The tensors of `leaves`, (path, value) pairs, as "args[0] float32 (4, 16), ..." (at most 6)."""
    tensors = [(name, v) for name, v in leaves if isinstance(v, torch.Tensor)]
    return ", ".join(f"{name} {_dtype(v.dtype)} {tuple(v.shape)}" for name, v in tensors[:6]) or "no tensors"


def note_step_error(
    error: BaseException, module: nn.Module, leaves: list[tuple[str, Any]], published: bool = False
) -> None:
    """Add a note to `error` (raised calling the compiled `module` with `leaves`, (path, value) pairs) unless it is
    one of this package's own errors, which name their cause already, or was noted before. `published`: the
    error was published to the peer ranks (`rank_consistency.publish_trace_failure`)."""
    if getattr(error, _NOTED, False) or not isinstance(error, Exception) or _raised_here(error):
        return
    setattr(error, _NOTED, True)
    tensors = [(name, v) for name, v in leaves if isinstance(v, torch.Tensor)]
    lines = [
        f"fsdp2_compile: raised in the compiled step of {type(module).__name__}, called with {shown_inputs(leaves)}."
    ]
    if published:
        lines.append(
            "The other ranks were told, with this rank's inputs, and stop too: if their inputs have other shapes, "
            f"{_SAME_INPUTS}."
        )
    mp = state_of(module).mp_policy if is_sharded(module) else MixedPrecisionPolicy()
    param = next(iter(module.parameters()), None)
    compute = mp.param_dtype or (None if param is None else param.dtype)  # the dtype the parameters compute in
    odd = [name for name, v in tensors if v.is_floating_point() and v.dtype != compute]
    if compute is not None and odd and not (mp.param_dtype is not None and mp.cast_forward_inputs):
        lines.append(
            f"{', '.join(odd)} {'is' if len(odd) == 1 else 'are'} not {_dtype(compute)}, the dtype the parameters "
            "compute in: cast the input, or keep MixedPrecisionPolicy(cast_forward_inputs=True)."
        )
    if mp.param_dtype is not None and mp.buffer_dtype is None:  # the policy casts parameters, not buffers
        buffers = [n for n, b in module.named_buffers() if b.is_floating_point() and b.dtype != compute][:3]
        if buffers:
            lines.append(
                f"Buffer {', '.join(repr(b) for b in buffers)} {'is' if len(buffers) == 1 else 'are'} not "
                f"{_dtype(compute)}: MixedPrecisionPolicy casts parameters, not buffers; pass "
                f"MixedPrecisionPolicy(buffer_dtype={compute}) to shard, or cast it in forward."
            )
    if "got mixed torch.Tensor and DTensor" in str(error):  # DTensor's own message
        lines.append(
            f"The parameters of {type(module).__name__} are DTensor shards outside the gathered reads of its "
            "submodules' forward (module.weight): a value computed from model.parameters() (an L2 penalty summed over "
            "them) is a DTensor; make it a plain tensor before mixing it with others, e.g. "
            "sum(p.pow(2).sum() for p in self.parameters()).full_tensor() (one all-reduce, on every rank)."
        )
    lines.append(
        'To see the line of your model that raised it, run the step under torch.compiler.set_stance("force_eager") '
        "(the same sharded model, uncompiled)."
    )
    error.add_note(" ".join(lines))


def note_peer_failure(error: BaseException, leaves: list[tuple[str, Any]]) -> None:
    """`error` says that a peer rank failed to compile a graph this rank's call (`leaves`) compiled: a note naming
    the inputs whose shape or dtype differs from the peer's (as its published failure shows them), if any."""
    peer = error
    while peer is not None and not isinstance(peer, PeerCompileFailed):
        peer = getattr(peer, "inner_exception", None) or peer.__cause__
    if peer is None or getattr(error, _NOTED, False):
        return
    setattr(error, _NOTED, True)
    mine = [(name, f"{_dtype(v.dtype)} {tuple(v.shape)}") for name, v in leaves if isinstance(v, torch.Tensor)]
    differ = []
    for rank, message in peer.failures:
        for name, here in mine:
            there = re.search(r"(?<!\w)" + re.escape(name) + r" (\w+ \([\d, ]*\))", message)
            if there and there.group(1) != here:
                differ.append(f"{name} is {here} on this rank and {there.group(1)} on rank {rank}")
    if differ:
        error.add_note(f"fsdp2_compile: {'; '.join(differ[:4])}: {_SAME_INPUTS}.")


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


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
