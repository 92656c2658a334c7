"""Reduced copies of a model for the planner: the same model with its repeated block list cut to n blocks.

A factory that takes `layers=` is asked for n layers; any other factory is called as it is and the model's longest
`nn.ModuleList` of blocks of one type (its repeated blocks) is replaced by its first n blocks. Per-block figures are
then the 2-block copy's minus the 1-block copy's, scaled to the full block count (`scale`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import nn

__all__ = ["block_list", "cut_blocks", "reduced_copy", "scale"]


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList | None]:
    """The longest `nn.ModuleList` of the model (its repeated blocks) and its path."""
    best = ("", None)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and (best[1] is None or len(module) > len(best[1])):
            best = (name, module)
    return best


def cut_blocks(model: nn.Module, n: int) -> str:
    """Keep the first `n` blocks of the model's block list, in place; returns the list's path."""
    path, blocks = block_list(model)
    if blocks is None:
        raise ValueError("the model has no nn.ModuleList of blocks to cut")
    if len({type(b) for b in blocks}) != 1:
        raise ValueError(f"the blocks of '{path}' are not all of one type; cannot cut it to {n} blocks")
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, nn.ModuleList(list(blocks)[:n]))
    return path


def reduced_copy(factory: Callable, n: int, call: Callable = lambda f, **kw: f(**kw)):
    """`(model, args, loss_fn, how)`: the factory's model with `n` blocks; `how` says how it was reduced."""
    if "layers" in inspect.signature(factory).parameters:
        return (*call(factory, layers=n), f"the factory's layers={n}")
    model, args, loss_fn = call(factory)
    path = cut_blocks(model, n)
    return model, args, loss_fn, f"'{path}' cut to its first {n} block(s)"


def scale(one: float, two: float, blocks: int) -> float:
    """Linear in the block count through the 1- and 2-block figures."""
    return two + (blocks - 2) * (two - one)
