"""What `shard` runs around a sharded module's forward, kept so that another method can run inside it too.

FSDP2 runs its pre- and post-forward logic around `forward` only, and `register_fsdp_forward_method` runs it around
another method too (a `generate`, a `features`). `shard` adds two kinds:

- forward hooks (`add_forward_hooks`: the mixed-precision input and output casts), registered on the module and
  recorded;
- eager scopes (`add_eager_scope`: the eager read scope, eager resharding), context managers entered around an
  eager forward only: by a pair of forward hooks, or, for a block traced once (`scopes_in_forward`), by its class's
  `forward` (`in_eager_scopes`), since hooks that do nothing while Dynamo compiles would still be traced, for every
  block, by every launch. (A module a user compiles by itself keeps its hooks: Dynamo runs them and starts its
  trace at `forward`, whose parameters name the graph's inputs.)

`register_fsdp_forward_method` wraps the method in both, in the order `nn.Module` runs them. The user's own hooks
are not run, as in FSDP2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "add_eager_scope",
    "add_forward_hooks",
    "in_eager_scopes",
    "register_fsdp_forward_method",
    "scopes_in_forward",
]

PreHook = Callable[[nn.Module, tuple, dict], "tuple[tuple, dict] | None"]
PostHook = Callable[[nn.Module, tuple, Any], Any]
Scope = Callable[[], contextlib.AbstractContextManager]


@dataclasses.dataclass
class _Around:
    hooks: list[tuple[PreHook | None, PostHook | None]] = dataclasses.field(default_factory=list)
    """The (pre, post) pairs `add_forward_hooks` registered, in order."""
    scopes: list[Scope] = dataclasses.field(default_factory=list)
    """What the eager forward runs inside (`add_eager_scope`), outermost first."""
    scope_hooks: list = dataclasses.field(default_factory=list)
    """The handles of the hooks that enter and leave the scopes (none once `scopes_in_forward`)."""
    entered: list[contextlib.ExitStack] = dataclasses.field(default_factory=list)
    """The scopes the hooks entered, by running forward (innermost last)."""


_AROUND: weakref.WeakKeyDictionary[nn.Module, _Around] = weakref.WeakKeyDictionary()
"""By sharded module: what `shard` runs around its forward."""


def add_forward_hooks(module: nn.Module, pre: PreHook | None = None, post: PostHook | None = None) -> None:
    """Register `pre` (called as `pre(module, args, kwargs)`; may return new `(args, kwargs)`) and `post` (called as
    `post(module, args, output)` even when the forward raised; may return a new output) on `module`'s forward, and
    record them for `register_fsdp_forward_method`."""
    if pre is not None:
        module.register_forward_pre_hook(pre, with_kwargs=True)
    if post is not None:
        module.register_forward_hook(post, always_call=True)
    _AROUND.setdefault(module, _Around()).hooks.append((pre, post))


def add_eager_scope(module: nn.Module, scope: Scope) -> None:
    """Run `module`'s forward inside `scope()` when it is not being compiled."""
    around = _AROUND.setdefault(module, _Around())
    if not around.scopes:
        around.scope_hooks = [
            module.register_forward_pre_hook(lambda m, _args: _enter_scopes(m)),
            module.register_forward_hook(lambda m, _args, _output: _leave_scopes(m), always_call=True),
        ]
    around.scopes.append(scope)


def scopes_in_forward(module: nn.Module) -> None:
    """`module`'s class's forward is `in_eager_scopes`: its scopes are entered there, its scope hooks go."""
    around = _AROUND.get(module)
    if around is not None:
        for handle in around.scope_hooks:
            handle.remove()
        around.scope_hooks = []


def _enter_scopes(module: nn.Module) -> None:
    if not torch.compiler.is_compiling():
        _AROUND[module].entered.append(_entered_scopes(module))


def _leave_scopes(module: nn.Module) -> None:
    if not torch.compiler.is_compiling() and _AROUND[module].entered:
        _AROUND[module].entered.pop().close()


def _entered_scopes(module: nn.Module) -> contextlib.ExitStack:
    """The scopes `add_eager_scope` gave `module`, entered; closing it leaves them."""
    with contextlib.ExitStack() as stack:
        for scope in _AROUND[module].scopes if module in _AROUND else ():
            stack.enter_context(scope())
        return stack.pop_all()


def in_eager_scopes(forward: Callable) -> Callable:
    """`forward` (a module class's), run inside the scopes `add_eager_scope` gave the module, unless compiling."""

    @functools.wraps(forward)
    def forward_in_eager_scopes(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return forward(self, *args, **kwargs)
        with _entered_scopes(self):
            return forward(self, *args, **kwargs)

    return forward_in_eager_scopes


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run `module.<method_name>` as `shard` runs `module.forward`: inputs cast by its mixed-precision policy, its
    parameters gathered once for the call in eager mode and released after, the output cast (FSDP2's function of
    the same name). A module `shard` did not shard is left as it is, as FSDP2 leaves a module that is not an
    `FSDPModule`."""
    if module not in _AROUND:
        return
    hooks = _AROUND[module].hooks
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
            if torch.compiler.is_compiling():
                output = method(*args, **kwargs)
            else:
                with _entered_scopes(module):
                    output = method(*args, **kwargs)
        finally:
            for _, post in hooks:
                changed = post(module, args, output) if post is not None else None
                if changed is not None:
                    output = changed
        return output

    setattr(module, method_name, as_forward)
