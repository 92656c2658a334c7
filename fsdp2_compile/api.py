"""`shard_compile`: `shard` + compilation through the fsdp2 backend; the backend itself (`fsdp2_backend`, the
`torch.compile(backend="fsdp2")` entry point) and `make_backend` for a non-default `CompileConfig`."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from fsdp2_compile._torch_private import forget_compiled_code, module_call_impl, set_compiled_call_impl
from fsdp2_compile.compiler import first_call
from fsdp2_compile.compiler.backend import check_input_devices, compile_sharded
from fsdp2_compile.compiler.compile_gc import full_collections_deferred
from fsdp2_compile.compiler.graph_records import GraphRecord, drop_records_of, dump_requested, records_owned_by
from fsdp2_compile.compiler.rank_consistency import forget_frames_of, publish_trace_failure
from fsdp2_compile.compiler.step_errors import note_peer_failure, note_step_error, shown_inputs
from fsdp2_compile.compiler.step_watch import forget_counts_of
from fsdp2_compile.config import CompileConfig, MixedPrecisionPolicy, compiler_for
from fsdp2_compile.runtime.free_memory import resolve_memory_budget
from fsdp2_compile.runtime.param_state import GradDeliveryRefresh
from fsdp2_compile.runtime.sharding import shard
from fsdp2_compile.runtime.traced_blocks import TRACES_BLOCKS_ONCE
from fsdp2_compile.runtime.validation import check_no_new_params, resolve_mesh

__all__ = ["fsdp2_backend", "make_backend", "shard_compile"]


def _dump_if_requested(record: GraphRecord) -> None:
    """Write the debug dump of a compiled graph when $FSDP2_COMPILE_DUMP asks for one (the drawing code is
    imported only then)."""
    if dump_requested():
        from fsdp2_compile.debug.dump import dump_from_env

        dump_from_env(record)


def fsdp2_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], config: CompileConfig | None = None):
    """torch.compile backend: lowers the fsdp2 ops of a captured graph of a sharded module into collectives."""
    return compile_sharded(gm, example_inputs, config, on_record=_dump_if_requested)


setattr(fsdp2_backend, TRACES_BLOCKS_ONCE, True)


def make_backend(config: CompileConfig) -> Callable:
    """The backend with a non-default config (what `shard_compile` passes to torch.compile)."""
    return functools.partial(fsdp2_backend, config=config)


def shard_compile(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    ignored_params: Iterable[nn.Parameter] | None = None,
    offload_policy: object = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    check_same_init: bool = True,
    compile_config: CompileConfig = CompileConfig(),
    dynamic: bool | None = None,
) -> nn.Module:
    """Shard `module` in place (see `shard`, whose options it takes) and compile its forward with the fsdp2 backend;
    returns `module`.

    The module is compiled in place (`module.compile`), so parameter names and `state_dict()` keys are unchanged.
    `compile_config`: how the backend compiles (`CompileConfig`; its `compiler` None chooses by the mesh's device).
    `dynamic`: passed to `torch.compile` (None: Dynamo's default, one dynamic recompile when a size changes).
    Its first call, on every rank, agrees on how the ranks start and measures the link (`compiler/first_call.py`).
    """
    if not isinstance(compile_config, CompileConfig):
        raise TypeError(
            f"shard_compile(compile_config=...) must be a fsdp2_compile.CompileConfig, got "
            f"{type(compile_config).__name__}; e.g. compile_config=fc.CompileConfig(prefetch_depth=1)"
        )
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError(f"shard_compile(dynamic={dynamic!r}): use True, False or None, as torch.compile")
    _check_bucket_names(module, compile_config)
    shard(
        module,
        mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        ignored_params=ignored_params,
        offload_policy=offload_policy,
        shard_placement_fn=shard_placement_fn,
        check_same_init=check_same_init,
    )
    mesh = resolve_mesh(mesh)
    if compile_config.memory_budget_fraction is not None:
        compile_config = resolve_memory_budget(compile_config, mesh)
    compiler = compiler_for(compile_config, mesh.device_type)
    compile_config = dataclasses.replace(compile_config, compiler=compiler)
    compile_in_place(module, make_backend(compile_config), dynamic=dynamic, config=compile_config)
    return module


def compile_in_place(module: nn.Module, backend, config: CompileConfig, dynamic: bool | None = None) -> None:
    """Like `module.compile(...)`, but traced from a frame outside torch.nn so Dynamo does not skip it. With
    `config.defer_full_gc`, Python's full collections wait during each call (`compile_gc.py`: Dynamo's tracing
    included).

    (`nn.Module.compile` compiles `_call_impl`, a frame Dynamo skips for built-in containers such as
    `nn.Sequential`; `torch.compile(module)` would add an `_orig_mod.` prefix to every parameter name.)
    """

    def call(*args, **kwargs):
        _check_call_inputs(module, args, kwargs)  # traced: runs when Dynamo compiles, guarded like the inputs
        return module_call_impl(module)(*args, **kwargs)

    # A code object of its own: Dynamo keeps at most `recompile_limit` (8) graphs per code object, and every
    # module compiled here would otherwise share `call`'s, so the 9th would silently run uncompiled. What Dynamo
    # compiled for it is dropped with the module.
    call.__code__ = call.__code__.replace()
    owner = id(module)
    weakref.finalize(module, _forget_compiled, call.__code__, owner)
    compiled = torch.compile(call, backend=backend, dynamic=dynamic)
    refresh = GradDeliveryRefresh(module)
    started = False

    def refreshed_call(*args, **kwargs):
        nonlocal started
        refresh()  # eager: which parameters have post-accumulate-grad hooks now
        try:
            with records_owned_by(owner), full_collections_deferred(config.defer_full_gc):
                if not started:
                    started = True
                    check_no_new_params(module)  # before the first call's exchange: on every rank alike
                    first_call.start(refresh.places, config)
                return compiled(*args, **kwargs)
        except Exception as e:
            leaves = [*_named_leaves("args", args), *_named_leaves("kwargs", kwargs)]
            kind = "forward" if _needs_grad(module, leaves) else "inference"
            called = f"called with {shown_inputs(leaves)}"
            published = publish_trace_failure(e, _group_names(refresh.places), kind, owner, called)
            note_peer_failure(e, leaves)
            note_step_error(e, module, leaves, published)
            raise

    set_compiled_call_impl(module, refreshed_call)


def _group_names(places) -> set[str]:
    """The process groups of the parameters at `places` (those a graph of them gathers and reduces over)."""
    return {
        name
        for _, _, info in places
        for name in (info.group_name, info.replicate_group_name, info.post_forward_group_name)
        if name
    }


def _needs_grad(module: nn.Module, leaves: list[tuple[str, Any]]) -> bool:
    """Whether a call of `module` with `leaves` is traced as a training forward (else as an inference graph)."""
    if not torch.is_grad_enabled():
        return False
    tensors = [v for _, v in leaves if isinstance(v, torch.Tensor)]
    return any(p.requires_grad for p in module.parameters()) or any(t.requires_grad for t in tensors)


def _forget_compiled(code, owner: int) -> None:
    """A module compiled in place died: drop what Dynamo compiled for it and the records of its graphs."""
    forget_compiled_code(code)
    drop_records_of(owner)
    forget_counts_of(owner)
    forget_frames_of(owner)


def _check_bucket_names(module: nn.Module, config: CompileConfig) -> None:
    """`CompileConfig.buckets` as module names: each must name a submodule of `module`."""
    if not isinstance(config.buckets, tuple):
        return
    names = {name for name, _ in module.named_modules()}
    missing = [b for b in config.buckets if b not in names]
    if missing:
        shown = ", ".join(sorted(n for n in names if n and n.count(".") <= 1)[:8])
        raise ValueError(
            f"CompileConfig.buckets names {missing}, which {'is' if len(missing) == 1 else 'are'} not a submodule of "
            f"{type(module).__name__}; use module paths as named_modules() gives them, e.g. {shown}"
        )


def _check_call_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Input tensors must be on the device of the module's (sharded) parameters; see `check_input_devices`."""
    param = next(iter(module.parameters()), None)
    if param is None:
        return
    leaves = [*_named_leaves("args", args), *_named_leaves("kwargs", kwargs)]
    with_data = any(isinstance(v, torch.Tensor) and v.device.type != "meta" for _, v in leaves)
    if param.device.type == "meta" and with_data:  # all-meta calls are shape-only runs (the CLI's, a planner's)
        name = next(n for n, p in module.named_parameters() if p is param)
        raise RuntimeError(
            f"parameter '{name}' of {type(module).__name__} is on the meta device: allocate and initialise the "
            "shards before the first forward, e.g. model.to_empty(device=...) then, inside "
            "fsdp2_compile.sharded_parameters(), model.init_weights() / reset_parameters()"
        )
    check_input_devices(leaves, param.device)


def _named_leaves(name: str, obj: Any) -> list[tuple[str, Any]]:
    """(path, leaf) of nested tuples, lists and dicts, e.g. ("kwargs['input_ids']", tensor)."""
    if isinstance(obj, (tuple, list)):
        return [leaf for i, o in enumerate(obj) for leaf in _named_leaves(f"{name}[{i}]", o)]
    if isinstance(obj, dict):
        return [leaf for k, o in obj.items() for leaf in _named_leaves(f"{name}[{k!r}]", o)]
    return [(name, obj)]
