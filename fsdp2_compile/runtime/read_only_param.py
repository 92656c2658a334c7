"""What reading a sharded module's parameter gives outside a compiled graph: the gathered parameter as a
`GatheredCopy`, a plain tensor in every computation (autograd included) that refuses to be written.

A write would change a temporary copy, never the sharded parameter: the silent mistake of `module.weight.data =
value`, `module.weight.data.normal_()`, `nn.init.zeros_(module.weight)` or `module.weight.copy_(...)` after
`shard`. So setting an attribute (`.data`, `.grad`, `.requires_grad`), an in-place method (`copy_`, `normal_`,
`zero_`, ...), item assignment and augmented assignment raise, naming the parameter and what works instead. Results
of computations are plain tensors; `.data` of a copy is again a `GatheredCopy`. Reading `.grad`, which a copy
never gets, raises too, naming where the gradient is.
"""

from __future__ import annotations

import torch

from fsdp2_compile._torch_private import disable_torch_function_subclass

__all__ = ["GatheredCopy", "gathered_copy"]


def _write(func) -> str | None:
    """How `func` would write its first argument, or None when it does not."""
    name = getattr(func, "__name__", "")
    if name == "__set__":
        return f"setting .{func.__self__.__name__}"
    if name == "__setitem__":
        return "item assignment"
    if name.startswith("__i") and name.endswith("__"):
        return f"augmented assignment ({name})"
    if name.endswith("_") and not name.endswith("__"):
        return f".{name}()"
    return None


_DATA_GET = torch.Tensor.data.__get__
_GRAD_GET = torch.Tensor.grad.__get__


class GatheredCopy(torch.Tensor):
    """A gathered parameter read outside a compiled graph (see the module docstring); `fsdp2_fqn` names it."""

    fsdp2_fqn: str

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        target = args[0] if args else None
        if isinstance(target, GatheredCopy) and (write := _write(func)) is not None:
            raise RuntimeError(
                f"parameter '{target.fsdp2_fqn}' of a sharded module is read as a gathered copy: {write} would "
                "change the copy, not the sharded parameter. To set parameters after fsdp2_compile.shard, use "
                "load_state_dict / set_model_state_dict, or write the shards in place inside `with "
                "fsdp2_compile.sharded_parameters():`, where module.weight is the DTensor parameter itself "
                "(nn.init.* and copy_ from a DTensor work there)"
            )
        if isinstance(target, GatheredCopy) and func == _GRAD_GET:
            raise RuntimeError(
                f"parameter '{target.fsdp2_fqn}' of a sharded module is read as a gathered copy, which never gets "
                "a gradient (its .grad would be None): the gradient is on the sharded parameter. Read it as "
                f"dict(model.named_parameters())['{target.fsdp2_fqn}'].grad, or module.weight.grad inside `with "
                "fsdp2_compile.sharded_parameters():` (a DTensor, as with fully_shard; .full_tensor() for all rows)"
            )
        with disable_torch_function_subclass():
            out = func(*args, **(kwargs or {}))
        if func == _DATA_GET:
            return gathered_copy(out, target.fsdp2_fqn)
        return out


def gathered_copy(full: torch.Tensor, fqn: str) -> GatheredCopy:
    """`full` (an alias of it, in the same autograd graph) as the `GatheredCopy` of parameter `fqn`."""
    copy = full.as_subclass(GatheredCopy)
    copy.fsdp2_fqn = fqn
    return copy
