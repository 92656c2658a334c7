"""The forward hooks `shard` puts on a module, kept so that another method can run inside them.

FSDP2 runs its pre- and post-forward logic around `forward` only, and `register_fsdp_forward_method` runs it around
another method too (a `generate`, a `features`). `shard` registers its hooks (input and output casts, the eager
read scope, eager resharding) through `add_forward_hooks`, which also records them; `register_fsdp_forward_method`
wraps the method in the recorded ones, in the order `nn.Module` runs them. The user's own hooks are not run, as in
FSDP2.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["add_forward_hooks", "register_fsdp_forward_method"]

PreHook = Callable[[nn.Module, tuple, dict], "tuple[tuple, dict] | None"]
PostHook = Callable[[nn.Module, tuple, Any], Any]

_HOOKS: weakref.WeakKeyDictionary[nn.Module, list[tuple[PreHook | None, PostHook | None]]] = weakref.WeakKeyDictionary()
"""By sharded module: the (pre, post) pairs `add_forward_hooks` registered on it, in order."""


def add_forward_hooks(module: nn.Module, pre: PreHook | None = None, post: PostHook | None = None) -> None:
    """Register `pre` (called as `pre(module, args, kwargs)`; may return new `(args, kwargs)`) and `post` (called as
    `post(module, args, output)` even when the forward raised; may return a new output) on `module`'s forward, and
    record them for `register_fsdp_forward_method`."""
    if pre is not None:
        module.register_forward_pre_hook(pre, with_kwargs=True)
    if post is not None:
        module.register_forward_hook(post, always_call=True)
    _HOOKS.setdefault(module, []).append((pre, post))


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run `module.<method_name>` as `shard` runs `module.forward`: inputs cast by its mixed-precision policy, its
    parameters gathered once for the call in eager mode and released after, the output cast (FSDP2's function of
    the same name). A module `shard` did not shard is left as it is, as FSDP2 leaves a module that is not an
    `FSDPModule`."""
    hooks = _HOOKS.get(module)
    if hooks is None:
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r} to register as a forward method")

    @functools.wraps(method)
    def as_forward(*args: Any, **kwargs: Any) -> Any:
        for pre, _ in hooks:
            changed = pre(module, args, kwargs) if pre is not None else None
            if changed is not None:
                args, kwargs = changed
        output = None
        try:
            output = method(*args, **kwargs)
        finally:
            for _, post in hooks:
                changed = post(module, args, output) if post is not None else None
                if changed is not None:
                    output = changed
        return output

    setattr(module, method_name, as_forward)
