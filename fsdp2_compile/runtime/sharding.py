"""`shard(module, mesh)`: FSDP2's parameter layout, applied in place."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp2_compile._torch_private import (
    concatenate_meshes,
    default_reduce_dtype,
    is_namedtuple,
    nested_regions_take_blocks,
    own_buffers,
    own_parameters,
    strided_shard,
)
from fsdp2_compile.config import MixedPrecisionPolicy
from fsdp2_compile.core.group_caches import forget_destroyed_groups
from fsdp2_compile.runtime.eager_reads import read_once_in_eager_forward
from fsdp2_compile.runtime.eager_reshard import reshard_in_eager_forward
from fsdp2_compile.runtime.float8 import float8_cast_of, high_precision
from fsdp2_compile.runtime.forward_hooks import add_forward_hooks, in_eager_scopes, scopes_in_forward
from fsdp2_compile.runtime.fsdp_module import FSDPModule, noting_size_mismatches
from fsdp2_compile.runtime.param_state import (
    IGNORED_ATTR,
    INFOS_ATTR,
    REPLACED,
    SHARDED_MODULES,
    STATE_ATTR,
    ParamInfo,
    ShardState,
    TPLayout,
    drop_kept_of,
    infos_of,
    is_known_param,
    is_sharded,
    managed_params,
    read_managed,
    sharded_parameters,
    state_of,
)
from fsdp2_compile.runtime.pipeline_stages import register_state_views
from fsdp2_compile.runtime.process_groups import fsdp_group, resolve_reshard
from fsdp2_compile.runtime.traced_blocks import traced_once
from fsdp2_compile.runtime.validation import (
    check_ignored,
    check_modules,
    check_new_params,
    check_no_aliases,
    check_no_unsynced_grads,
    check_optimizer,
    check_options,
    check_same_call,
    check_same_values,
    default_device_type,
    resolve_mesh,
    warn_on_mixed_param_dtypes,
)

__all__ = [
    "FSDPModule",
    "ParamInfo",
    "ShardState",
    "default_device_type",
    "is_known_param",
    "is_sharded",
    "managed_params",
    "shard",
    "sharded_parameters",
]


def _mesh_groups(mesh: DeviceMesh) -> tuple[int, str, int, str]:
    """(shard size, shard group, replicate size, replicate group) of a 1-D mesh or a 2-D (replicate, shard) one:
    the groups FSDP's collectives run on (`process_groups.fsdp_group`)."""
    shard_dim = mesh.ndim - 1
    shard_size, shard_group = mesh.size(shard_dim), fsdp_group(mesh.get_group(shard_dim).group_name)
    if mesh.ndim == 1:
        return shard_size, shard_group, 1, ""
    return shard_size, shard_group, mesh.size(0), fsdp_group(mesh.get_group(0).group_name)


def _shard_param(param: nn.Parameter, mesh: DeviceMesh, offload: CPUOffloadPolicy | None, dim: int = 0) -> nn.Parameter:
    """This rank's chunk of dim `dim` (rows by default; `shard_placement_fn`) on the mesh's last (shard) dim;
    replicated over a 2-D mesh's first dim. A tensor-parallel DTensor: its TP-local tensor's rows, on the (dp, tp)
    mesh (see the comment above `shard`). `offload` (`CPUOffloadPolicy`): the chunk is kept on the CPU, pinned when the
    policy asks and an accelerator can use pinned memory."""
    world_size, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    data = high_precision(param.detach().to_local() if isinstance(param, DTensor) else param.detach())
    chunks = torch.chunk(data, world_size, dim=dim)
    local = chunks[rank] if rank < len(chunks) else data.narrow(dim, 0, 0)
    dp = [Shard(dim)] if mesh.ndim == 1 else [Replicate(), Shard(dim)]
    on = mesh
    if isinstance(param, DTensor):
        tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
        if tp_placements[0].is_shard(dim):  # TP's blocks of that dim are split again by dp: strided, as FSDP2 does
            dp[-1] = strided_shard(dim, tp_mesh.size())
        dp, on = [*dp, *tp_placements], concatenate_meshes([mesh, tp_mesh])
    local = local.clone()
    if offload is not None and not local.is_meta:
        local = local.cpu()
        if offload.pin_memory and torch.accelerator.is_available():
            local = local.pin_memory()
    dtensor = DTensor.from_local(local, on, dp, run_check=False, shape=param.shape, stride=param.stride())
    return nn.Parameter(dtensor, requires_grad=param.requires_grad)


def _tp_layout(param: nn.Parameter) -> TPLayout | None:
    if not isinstance(param, DTensor):
        return None
    return TPLayout(param.device_mesh, tuple(param.placements), param.shape, param.stride())


def _install_properties(
    module: nn.Module, infos: dict[str, ParamInfo], fsdp_module: bool = False, compiled_once: bool = False
) -> None:
    """Give `module` the `ParamInfo`s of `infos` (added to those it has) and swap its class for a subclass of its
    own whose attributes of those names return the gathered parameters; with `fsdp_module` (a module `shard` was
    called on) the subclass also derives from `FSDPModule`, with `compiled_once` its forward is traced once for all
    identical blocks (`block_gathers.py`). Modules of one class with the same managed names share the subclass, so
    that Dynamo sees identical blocks as instances of one class."""
    cls = type(module)
    base = cls.__bases__[0] if getattr(cls, "_fsdp2_generated", False) else cls
    if base is cls:  # the first managed names of this module
        module.register_load_state_dict_pre_hook(_refuse_plain_tensors)
    existing = {**infos_of(module), **infos}
    object.__setattr__(module, INFOS_ATTR, existing)
    fsdp_module = fsdp_module or isinstance(module, FSDPModule)
    compiled_once = compiled_once or getattr(cls, "_fsdp2_compiled_once", False)
    module.__class__ = _sharded_class(base, tuple(sorted(existing)), fsdp_module, compiled_once)


def _refuse_plain_tensors(module: nn.Module, state_dict: dict, prefix: str, *_args) -> None:
    """`load_state_dict`: a plain tensor for a managed (DTensor) parameter is the full state dict of an unsharded
    model, which DTensor's copy refuses without saying what to do; say it first (the last argument: torch's list of
    error messages)."""
    plain = [prefix + n for n in infos_of(module) if type(state_dict.get(prefix + n)) in (torch.Tensor, nn.Parameter)]
    if plain:
        _args[-1].append(
            f"{', '.join(repr(n) for n in plain)} {'is a plain tensor' if len(plain) == 1 else 'are plain tensors'} "
            "in the state dict, but the sharded model holds DTensors (each rank its shard). Load a full state dict "
            "with torch.distributed.checkpoint.state_dict.set_model_state_dict(model, state_dict, "
            "options=StateDictOptions(full_state_dict=True)), or a sharded one (a sharded model's state_dict(), "
            "fsdp2_compile.load_checkpoint)"
        )


def _not_copied(module: nn.Module, *_args) -> None:
    """What pickling (`torch.save(model)`) or deep-copying a sharded module does, as `fully_shard`'s refuses."""
    raise TypeError(
        f"fsdp2_compile: a sharded module ({type(module).__name__}) cannot be pickled (torch.save(model)) or "
        "deep-copied: its parameters are this rank's shards, its state lives with its process group. Save its state "
        "instead (fc.save_checkpoint, torch.distributed.checkpoint, or torch.save(model.state_dict()) inside "
        "fc.sharded_parameters()), and copy a model before sharding it"
    )


_SHARDED_CLASSES: weakref.WeakValueDictionary[tuple, type] = weakref.WeakValueDictionary()
"""(base class, managed names, FSDPModule or not, traced once or not) -> the generated subclass, while a module of
it lives: the user's class is held no longer than its sharded modules."""


def _sharded_class(base: type, names: tuple[str, ...], fsdp_module: bool, compiled_once: bool) -> type:
    key = (base, names, fsdp_module, compiled_once)
    cls = _SHARDED_CLASSES.get(key)
    if cls is None:
        cls = _SHARDED_CLASSES[key] = _make_sharded_class(base, names, fsdp_module, compiled_once)
    return cls


def _make_sharded_class(base: type, names: tuple[str, ...], fsdp_module: bool, compiled_once: bool) -> type:
    def gathered(name: str) -> property:
        return property(lambda self: read_managed(getattr(self, INFOS_ATTR)[name], own_parameters(self)[name]))

    namespace = {name: gathered(name) for name in names}
    namespace.update(_fsdp2_generated=True, _fsdp2_compiled_once=compiled_once, __module__=base.__module__)
    namespace.update(__reduce_ex__=_not_copied, __deepcopy__=_not_copied)
    if compiled_once:
        namespace["forward"] = in_eager_scopes(traced_once(base.forward))
    if fsdp_module:  # named as fully_shard names its FSDP{class}; a submodule under one keeps its class's name
        namespace["load_state_dict"] = noting_size_mismatches(base.load_state_dict)
        return type(f"Sharded{base.__name__}", (base, FSDPModule), namespace)
    return type(base.__name__, (base,), namespace)


def _group_path(root: nn.Module, mod_name: str, paths: dict[int, str]) -> str:
    """The bucket of a parameter of `root.get_submodule(mod_name)`: the path of the nearest module at or above it
    that `shard` was called on ("" = root); for a list of modules sharded together, the path of the first
    (`paths`: id(module) -> path under `root`)."""
    parts = mod_name.split(".") if mod_name else []
    for end in range(len(parts), 0, -1):
        path = ".".join(parts[:end])
        mod = root.get_submodule(path)
        if is_sharded(mod):
            leader = state_of(mod).members[0]()
            return paths.get(id(leader), path)
    return ""


def _cast_tree(obj, dtype: torch.dtype):
    """The floating tensors of `obj` cast to `dtype`, through lists, tuples (named ones too), dicts and dataclass
    instances, as `fully_shard` casts a forward's inputs."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if is_namedtuple(obj):
        return type(obj)(*(_cast_tree(o, dtype) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_tree(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_tree(v, dtype) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _cast_tree(getattr(obj, f.name), dtype) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **fields)
    return obj


def _register_mp_hooks(module: nn.Module, mp: MixedPrecisionPolicy) -> None:
    if mp.cast_forward_inputs and mp.param_dtype is not None:
        dtype = mp.param_dtype
        add_forward_hooks(module, pre=lambda _m, args, kwargs: (_cast_tree(args, dtype), _cast_tree(kwargs, dtype)))
    if mp.output_dtype is not None:
        out_dtype = mp.output_dtype
        add_forward_hooks(module, post=lambda _m, _args, output: _cast_tree(output, out_dtype))


# Every managed parameter becomes an `nn.Parameter` holding a `DTensor` sharded on dim 0 (`Shard(0)`, uneven
# rows follow `torch.chunk`, so a rank's shard may be empty). The module's class is swapped for a subclass with
# one property per managed parameter name, so that `module.weight` returns `unshard(shard)` — the gathered
# parameter, eager-correct and traceable — while `named_parameters()` / `state_dict()` keep the original names and
# show the sharded DTensors with their logical shapes.
#
# HSDP: on a 2-D mesh `(replicate, shard)` parameters are `DTensor [Replicate(), Shard(0)]`: sharded over the
# mesh's last dim, replicated over its first; gradients are reduce-scattered, then all-reduced over the replicas.
#
# FSDP + tensor parallelism: a parameter that is already a DTensor on a 1-D TP mesh (from `parallelize_module`)
# keeps its TP layout and is sharded over the dp mesh on top, as FSDP2 does: a DTensor on the concatenated (dp, tp)
# mesh, `[Shard(d) | _StridedShard(d) when TP also shards dim d, *tp placements]` (d: 0, or the dim
# `shard_placement_fn` chose; expert parallelism's `Shard(0)` experts alike). `module.weight` gathers over dp
# and returns the TP DTensor, so TP's own collectives (DTensor redistribution) trace into the same graph.
#
# What `shard` records is in `param_state.py`, what it refuses in `validation.py`, the methods sharded modules
# get in `fsdp_module.py`.
def shard(
    module: nn.Module | list[nn.Module],
    mesh: DeviceMesh | None = None,
    *,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    ignored_params: Iterable[nn.Parameter] | None = None,
    offload_policy: object = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    check_same_init: bool = True,
) -> nn.Module | list[nn.Module]:
    """Shard `module`'s parameters on dim 0 over `mesh`, in place, like FSDP2's `fully_shard`.

    Call it on each block first and on the root last: parameters already taken over by an earlier call stay in
    that call's group. A list of modules (e.g. `[model.norm, model.output]`) is one group: one all-gather and one
    reduce-scatter for all of them. Like `fully_shard`, it is collective: every rank of the mesh must call it.
    `mesh=None` means a 1-D mesh over the default process group. Parameters in `ignored_params` are left as they
    are (not sharded, not gathered, their gradients not reduced). Every module given becomes an `FSDPModule`.
    `reshard_after_forward`: True frees gathered parameters after forward and gathers them again in backward;
    False keeps them until backward; None (FSDP2's default) is True for every group but a root's (a call on a
    module no other call covers: the last, outermost one), which backward needs first and keeps, as FSDP2 does;
    an int k dividing the shard group's size keeps 1/k of each on every rank and gathers backward's from k ranks
    (`post_forward.py`).
    `offload_policy`: torch's `OffloadPolicy()` (no offload) or `CPUOffloadPolicy(pin_memory=)`: sharded parameters,
    gradients and optimizer state on the CPU, each shard copied to the mesh's device right before its all-gather
    (on a CPU mesh they are there already: pinning is skipped without an accelerator).
    `shard_placement_fn(param)`: `Shard(dim)` to shard that parameter on another dim (e.g. `Shard(1)` for expert
    weights whose dim 0 is smaller than the group), None for dim 0, as in `fully_shard`.
    `check_same_init` (not in `fully_shard`): first confirm through the store that every rank of the mesh makes this
    call, naming the ranks that do not or that shard other modules (a few store operations per mesh dim), then
    compare a checksum of each parameter over the mesh and refuse values that differ between ranks, naming the
    parameter (one pass over the parameters and three all-reduces per mesh dim); False skips both.
    Returns `module`.
    """
    members = check_modules(module)
    check_options(mp_policy, offload_policy)
    mp_policy = MixedPrecisionPolicy.of(mp_policy)
    forget_destroyed_groups()
    offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
    mesh = resolve_mesh(mesh)
    ignored = check_ignored(ignored_params, members)
    check_no_aliases(members, ignored)
    dims = check_new_params(members, mesh, ignored, offload is not None, shard_placement_fn)  # before any collective
    checked = (
        check_same_init and mesh.size() > 1 and torch.distributed.get_backend(mesh.get_group(mesh.ndim - 1)) != "fake"
    )
    if checked:  # every rank came, before the first collective (a gloo twin's token, the values' all-reduces)
        check_same_call(module, mesh)
    world_size, group_name, replicate_size, replicate_group_name = _mesh_groups(mesh)
    compute_device = _compute_device(mesh) if offload is not None and mesh.device_type != "cpu" else None
    reshard, post_forward_size, post_forward_group_name = resolve_reshard(
        reshard_after_forward, mesh.get_group(mesh.ndim - 1).group_name, world_size
    )
    if checked:
        check_same_values(members, mesh, ignored)
    for p in ignored.values():
        setattr(p, IGNORED_ATTR, True)

    taken: list[ParamInfo] = []
    for member in members:
        warn_on_mixed_param_dtypes(member, mp_policy)
        paths = {id(m): name for name, m in member.named_modules(remove_duplicate=False)}
        for mod_name, mod in member.named_modules(remove_duplicate=False):
            new_infos: dict[str, ParamInfo] = {}
            for pname, param in list(own_parameters(mod).items()):
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                if param is None or id(param) in ignored:
                    continue
                known = infos_of(mod).get(pname)
                if known is not None and isinstance(param, DTensor):  # taken over by an earlier call: rename only
                    known.fqn, known.bucket = fqn, _group_path(member, mod_name, paths)
                    continue
                if param in REPLACED:  # tied to a parameter sharded by an earlier call under another module
                    sharded, info = REPLACED[param]
                else:  # checked by check_new_params
                    dim = dims.get(id(param), 0)
                    sharded = _shard_param(param, mesh, offload, dim)
                    tp = _tp_layout(param)
                    info = ParamInfo(
                        fqn=fqn,
                        bucket=_group_path(member, mod_name, paths),
                        dim0=(param.to_local() if tp is not None else param).shape[dim],
                        shard_dim=dim,
                        world_size=world_size,
                        group_name=group_name,
                        param_dtype=mp_policy.param_dtype_of(param),
                        reduce_dtype=mp_policy.reduce_dtype or default_reduce_dtype(mp_policy.param_dtype, param),
                        reshard_after_forward=reshard,
                        auto_reshard=reshard_after_forward is None,
                        replicate_size=replicate_size,
                        replicate_group_name=replicate_group_name,
                        tp=tp,
                        post_forward_size=post_forward_size,
                        post_forward_group_name=post_forward_group_name,
                        compute_device=compute_device,
                        float8=float8_cast_of(fqn, param, sharded.to_local()),
                    )
                    REPLACED[param] = (sharded, info)
                    taken.append(info)
                own_parameters(mod)[pname] = sharded
                new_infos[pname] = info
            if new_infos:
                _install_properties(mod, new_infos)
        _cast_buffers(member, mp_policy.buffer_dtype)

    settle_root_resharding(members, taken)
    state = ShardState(tuple(taken), tuple(weakref.ref(m) for m in members), mp_policy)
    for member in members:
        _install_properties(member, {}, fsdp_module=True)
        _register_mp_hooks(member, mp_policy)
        reshard_in_eager_forward(member)  # acts only on parameters gathered with reshard_after_forward on
        if taken:
            read_once_in_eager_forward(member, taken[0].bucket)  # a parameter read twice is gathered once
        object.__setattr__(member, STATE_ATTR, state)
        SHARDED_MODULES.add(member)
    register_state_views(state)  # what torch's pipeline schedules reach (`pipeline_stages.py`)
    _hook_optimizers_while_alive(members, state.infos)
    _trace_blocks_once(members)
    return module


_STEP_HOOK: list = []
"""The handle of `_before_optimizer_step` while a module `shard` was called on lives."""
_LIVE_CALLS = [0]
"""How many `shard` calls have a module alive."""


def _before_optimizer_step(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    """Before an optimizer steps: refuse one built before `shard` (`check_optimizer`) or one whose parameters
    have gradients kept unreduced (`check_no_unsynced_grads`), and drop the gathered copies kept of the
    parameters it holds (`drop_kept_of`)."""
    check_optimizer(optimizer)
    check_no_unsynced_grads(optimizer)
    drop_kept_of(optimizer)


def _hook_optimizers_while_alive(members: list[nn.Module], infos: tuple[ParamInfo, ...]) -> None:
    """Register the optimizer step pre-hook while a module of any `shard` call lives. When the last module of this
    call dies, what is kept for its parameters outside them goes (`ParamInfo.forget`); when the last of every call
    dies, the hook."""
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_before_optimizer_step))
    _LIVE_CALLS[0] += 1
    alive = [len(members)]

    def gone() -> None:
        alive[0] -= 1
        if alive[0]:
            return
        for info in infos:
            info.forget()
        _LIVE_CALLS[0] -= 1
        if not _LIVE_CALLS[0]:
            _STEP_HOOK.pop().remove()

    for member in members:
        weakref.finalize(member, gone).atexit = False


def settle_root_resharding(members: list[nn.Module], taken: list[ParamInfo]) -> None:
    """FSDP2's `reshard_after_forward=None`: the groups sharded before under `members` are not roots (resharded
    after forward); this call's group is one until a later call covers it (kept for backward, which needs the
    root's parameters first: FSDP2 leaves the root's gathered after forward)."""
    for member in members:
        for mod in member.modules():
            if is_sharded(mod) and mod not in members:
                for info in state_of(mod).infos:
                    if info.auto_reshard:
                        info.reshard_after_forward = True
    for info in taken:
        if info.auto_reshard:
            info.reshard_after_forward = False


def _trace_blocks_once(members: list[nn.Module]) -> None:
    """The outermost modules sharded before, under `members`, are blocks of a larger model: Dynamo traces each
    distinct kind of them once (`block_gathers.py`). Not with tensor parallelism (TP's collectives must stay in
    the graph the passes see), nor with a parameter sharded on a dim other than 0 (`shard_placement_fn`: its
    gather moves that dim, which the rewrite does not carry out of the block), nor on a torch that cannot
    (`nested_regions_take_blocks`)."""
    if not nested_regions_take_blocks:
        return
    for member in members:
        for name, mod in member.named_modules():
            if not name or not is_sharded(mod) or any(is_sharded(a) for a in _ancestors(member, name)[:-1]):
                continue
            infos = [info for _, _, info in managed_params(mod)]
            if any(i.tp is not None or i.shard_dim or i.float8 is not None for i in infos):
                continue
            if any(getattr(type(m), "_fsdp2_compiled_once", False) for m in mod.modules()):
                continue  # traced once already, or has blocks traced once inside
            for info in infos:
                info.compiled_once = True
            _install_properties(mod, {}, fsdp_module=True, compiled_once=True)
            scopes_in_forward(mod)


def _compute_device(mesh: DeviceMesh) -> torch.device:
    """The accelerator this rank computes on: the mesh's device type at the current device index."""
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def _cast_buffers(module: nn.Module, dtype: torch.dtype | None) -> None:
    """`MixedPrecisionPolicy.buffer_dtype`: floating buffers of `module` outside groups sharded earlier, in place."""
    if dtype is None:
        return
    for name, mod in module.named_modules():
        if name and any(is_sharded(a) for a in _ancestors(module, name)):
            continue
        for bname, buf in own_buffers(mod).items():
            if buf is not None and buf.is_floating_point():
                own_buffers(mod)[bname] = buf.to(dtype)


def _ancestors(root: nn.Module, name: str) -> list[nn.Module]:
    """The modules on the path from `root` (excluded) down to `root.get_submodule(name)` (included)."""
    parts = name.split(".")
    return [root.get_submodule(".".join(parts[:end])) for end in range(1, len(parts) + 1)]
