"""`shard(module, mesh)`: FSDP2's parameter layout, applied in place.

Every managed parameter becomes an `nn.Parameter` holding a `DTensor` sharded on dim 0 (`Shard(0)`, uneven
rows follow `torch.chunk`, so a rank's shard may be empty). The module's class is swapped for a subclass with
one property per managed parameter name, so that `module.weight` returns `unshard(shard)` — the gathered
parameter, eager-correct and traceable — while `named_parameters()` / `state_dict()` keep the original names and
show the sharded DTensors with their logical shapes.

HSDP: on a 2-D mesh `(replicate, shard)` parameters are `DTensor [Replicate(), Shard(0)]`: sharded over the
mesh's last dim, replicated over its first; gradients are reduce-scattered, then all-reduced over the replicas.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.weak import WeakIdKeyDictionary

from .comm_groups import fsdp_group
from .config import MixedPrecisionPolicy
from .cost_model import measure_profile
from .eager_reshard import note_gathered, register_reshard_hooks
from .ops import unshard

__all__ = [
    "ParamInfo",
    "ShardState",
    "ShardedModule",
    "default_device_type",
    "is_known_param",
    "is_sharded",
    "managed_params",
    "shard",
    "sharded_parameters",
]

_STATE_ATTR = "_fsdp2_state"


@dataclass
class ParamInfo:
    """What the property of a managed parameter needs to gather it (the static args of `fsdp2::unshard`)."""

    fqn: str
    bucket: str
    """The module path of the `shard` call that took the parameter over: its FSDP group."""
    dim0: int
    world_size: int
    group_name: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype
    reshard_after_forward: bool
    replicate_size: int = 1
    """HSDP: ranks in the replicate group (gradients are all-reduced over it after the reduce-scatter)."""
    replicate_group_name: str = ""
    requires_gradient_sync: bool = True
    """False: backward keeps the unsharded gradient on this rank instead of reducing it (`set_requires_gradient_sync`)."""
    pending_key: str = ""
    """Where unsynced gradients are kept; set the first time sync is turned off (then synced backwards add them)."""

    def gather(self, param: nn.Parameter) -> torch.Tensor:
        if _SHARDED_ACCESS.active:
            return param
        if not isinstance(param, DTensor):
            raise TypeError(
                f"parameter '{self.fqn}' was replaced by a {type(param).__name__} after shard(); "
                "assign parameters before calling fsdp2_compile.shard, or load values with load_state_dict"
            )
        full = self._unshard(param)
        if self.reshard_after_forward and not torch.compiler.is_compiling():
            note_gathered(full, functools.partial(self._unshard, param))
        return full

    def _unshard(self, param: DTensor) -> torch.Tensor:
        return unshard(
            param.to_local(),
            self.dim0,
            self.world_size,
            self.group_name,
            self.param_dtype,
            self.reduce_dtype,
            self.fqn,
            self.bucket,
            self.reshard_after_forward,
            self.replicate_size,
            self.replicate_group_name,
            self.requires_gradient_sync,
            self.pending_key,
        )

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self.requires_gradient_sync = requires_gradient_sync
        if not requires_gradient_sync and not self.pending_key:
            self.pending_key = f"{self.fqn}@{id(self):x}"


@dataclass(frozen=True)
class ShardState:
    """Recorded on every module passed to `shard` (one FSDP2 "parameter group"); each parameter's own facts are in
    its `ParamInfo`."""

    param_fqns: tuple[str, ...]
    """The parameters this call took over, named relative to the module it was given."""


class _SharedFlag:
    active = False


_SHARDED_ACCESS = _SharedFlag()


@contextlib.contextmanager
def sharded_parameters() -> Iterator[None]:
    """Inside, `module.weight` of a sharded module is the sharded DTensor parameter itself, not the gathered
    tensor: for in-place initialisation (`reset_parameters`, `nn.init.*`) after `to_empty`, e.g. of a model
    built on the meta device. Not for use inside a compiled region."""
    _SHARDED_ACCESS.active, before = True, _SHARDED_ACCESS.active
    try:
        yield
    finally:
        _SHARDED_ACCESS.active = before


# original parameter -> (sharded parameter, its info), for parameters tied across shard() calls.
# Only the *original* parameters are keyed weakly: a weak reference to a sharded parameter would stop
# `module.to_empty` from swapping it (meta-device initialisation).
_REPLACED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_IGNORED_ATTR = "_fsdp2_ignored"


def is_sharded(module: nn.Module) -> bool:
    """True when `shard` was called on exactly this module."""
    return isinstance(getattr(module, _STATE_ATTR, None), ShardState)


def _infos(module: nn.Module) -> dict[str, ParamInfo]:
    return getattr(type(module), "_fsdp2_infos", {})


def managed_params(module: nn.Module) -> Iterator[tuple[str, nn.Parameter, ParamInfo]]:
    """(name, sharded parameter, info) of every parameter `shard` manages under `module`, tied ones once."""
    seen = set()
    for mod_name, mod in module.named_modules():
        for pname, info in _infos(mod).items():
            param = mod._parameters[pname]
            if id(param) not in seen:
                seen.add(id(param))
                yield (f"{mod_name}.{pname}" if mod_name else pname), param, info


def is_known_param(param: nn.Parameter) -> bool:
    """True for parameters `shard` manages (sharded DTensors) or was told to ignore."""
    return isinstance(param, DTensor) or getattr(param, _IGNORED_ATTR, False)


def default_device_type() -> str:
    """The device type of the default process group's mesh: the CPU for gloo or without an accelerator."""
    accelerator = torch.accelerator.current_accelerator()
    gloo = torch.distributed.get_backend() == "gloo"
    return "cpu" if gloo or accelerator is None else accelerator.type


def _default_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is None:
        if not torch.distributed.is_initialized():
            raise RuntimeError(
                "fsdp2_compile.shard(mesh=None) needs an initialised default process group; "
                "call torch.distributed.init_process_group first or pass a DeviceMesh"
            )
        return init_device_mesh(default_device_type(), (torch.distributed.get_world_size(),))
    if mesh.ndim > 2:
        raise ValueError(
            f"fsdp2_compile.shard got a {mesh.ndim}-D mesh {tuple(mesh.shape)}; FSDP uses a 1-D mesh (shard) "
            "or a 2-D mesh (replicate, shard). Slice the mesh, e.g. mesh['dp'], before passing it"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise ValueError(
            f"fsdp2_compile.shard got a 2-D mesh {tuple(mesh.shape)} without dim names; for HSDP create it as "
            'init_device_mesh(device_type, (replicas, shard_size), mesh_dim_names=("replicate", "shard"))'
        )
    return mesh


def _mesh_groups(mesh: DeviceMesh) -> tuple[int, str, int, str]:
    """(shard size, shard group, replicate size, replicate group) of a 1-D mesh or a 2-D (replicate, shard) one:
    the groups FSDP's collectives run on (`comm_groups.fsdp_group`)."""
    shard_dim = mesh.ndim - 1
    shard_size, shard_group = mesh.size(shard_dim), fsdp_group(mesh.get_group(shard_dim).group_name)
    if mesh.ndim == 1:
        return shard_size, shard_group, 1, ""
    return shard_size, shard_group, mesh.size(0), fsdp_group(mesh.get_group(0).group_name)


def _check_param(fqn: str, param: nn.Parameter, mesh: DeviceMesh) -> None:
    if param.dim() == 0:
        raise ValueError(
            f"parameter '{fqn}' is 0-dimensional; FSDP shards parameters on dim 0. "
            "Give it shape (1,) or pass it in ignored_params"
        )
    if param.device.type not in (mesh.device_type, "meta"):
        raise ValueError(
            f"parameter '{fqn}' is on device '{param.device}' but the mesh is on '{mesh.device_type}'; "
            f"move the module with module.to('{mesh.device_type}') before calling shard"
        )
    if isinstance(param, DTensor):
        raise ValueError(
            f"parameter '{fqn}' is already a DTensor not managed by fsdp2_compile; "
            "only plain parameters can be sharded"
        )


def _shard_param(param: nn.Parameter, mesh: DeviceMesh) -> nn.Parameter:
    """Rows of this rank's shard on the mesh's last (shard) dim; replicated over a 2-D mesh's first dim."""
    world_size, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    chunks = torch.chunk(param.detach(), world_size, dim=0)
    local = chunks[rank] if rank < len(chunks) else param.new_empty((0, *param.shape[1:]))
    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    dtensor = DTensor.from_local(
        local.clone(), mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    return nn.Parameter(dtensor, requires_grad=param.requires_grad)


class ShardedModule:
    """Methods FSDP2's `FSDPModule` offers, mixed into every module class `shard` swaps."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's gradient-accumulation switch. False: backward reduces no gradient; each rank keeps the
        unsharded gradients of this module's parameters (their `.grad` gets zeros), and the next backward with
        sync on adds them before the reduce-scatter, so micro-batches with sync off, then one with it on, equal
        one large batch. `recurse=False`: only the parameters of this module's own `shard` call.
        Each setting is one compiled graph (Dynamo guards on it)."""
        state = getattr(self, _STATE_ATTR, None)
        own = set(state.param_fqns) if state is not None and not recurse else None
        for name, _param, info in managed_params(self):
            if own is None or name in own:
                info.set_requires_gradient_sync(requires_gradient_sync)


def _install_properties(module: nn.Module, infos: dict[str, ParamInfo]) -> None:
    """Swap `module`'s class for a subclass of it and `ShardedModule` whose `name` attributes return the gathered
    parameters."""
    cls = type(module)
    base = cls.__bases__[0] if getattr(cls, "_fsdp2_generated", False) else cls
    existing = dict(getattr(cls, "_fsdp2_infos", {}))
    existing.update(infos)

    def make(name: str, info: ParamInfo) -> property:
        return property(lambda self: info.gather(self._parameters[name]))

    namespace = {name: make(name, info) for name, info in existing.items()}
    namespace.update(_fsdp2_generated=True, _fsdp2_infos=existing, __module__=base.__module__)
    module.__class__ = type(f"Sharded{base.__name__}", (base, ShardedModule), namespace)


def _group_path(root: nn.Module, mod_name: str) -> str:
    """Path (from `root`) of the nearest module at or above `mod_name` that `shard` was called on; "" = root."""
    parts = mod_name.split(".") if mod_name else []
    for end in range(len(parts), 0, -1):
        if is_sharded(root.get_submodule(".".join(parts[:end]))):
            return ".".join(parts[:end])
    return ""


def _cast_tree(obj, dtype: torch.dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_tree(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_tree(v, dtype) for k, v in obj.items()}
    return obj


def _register_mp_hooks(module: nn.Module, mp: MixedPrecisionPolicy) -> None:
    if mp.cast_forward_inputs and mp.param_dtype is not None:
        dtype = mp.param_dtype
        module.register_forward_pre_hook(
            lambda _m, args, kwargs: (_cast_tree(args, dtype), _cast_tree(kwargs, dtype)), with_kwargs=True
        )
    if mp.output_dtype is not None:
        out_dtype = mp.output_dtype
        module.register_forward_hook(lambda _m, _args, output: _cast_tree(output, out_dtype))


def shard(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    ignored_params: Iterable[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard `module`'s parameters on dim 0 over `mesh`, in place, like FSDP2's `fully_shard`.

    Call it on each block first and on the root last: parameters already taken over by an earlier call stay in
    that call's group. Like `fully_shard`, it is collective: every rank of the mesh must call it (the first call
    on a process group measures the link and compute speed for the scheduler, agreed across ranks). `mesh=None` means a 1-D mesh over the default process group. Parameters in
    `ignored_params` are left as they are (not sharded, not gathered, their gradients not reduced).
    Returns `module`.
    """
    if is_sharded(module):
        raise ValueError(
            f"module {type(module).__name__} is already sharded by fsdp2_compile.shard; call shard once per module"
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    mesh = _default_mesh(mesh)
    world_size, group_name, replicate_size, replicate_group_name = _mesh_groups(mesh)
    if world_size > 1 and torch.distributed.get_backend(mesh.get_group(mesh.ndim - 1)) != "fake":
        # for the scheduler's cost model; measured once per process group
        measure_profile(group_name, world_size, mesh.device_type)
    ignored = {id(p) for p in (ignored_params or ())}
    for p in ignored_params or ():
        setattr(p, _IGNORED_ATTR, True)

    param_fqns: list[str] = []
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        new_infos: dict[str, ParamInfo] = {}
        for pname, param in list(mod._parameters.items()):
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            if param is None or id(param) in ignored:
                continue
            known = _infos(mod).get(pname)
            if known is not None and isinstance(param, DTensor):  # taken over by an earlier call: rename only
                known.fqn, known.bucket = fqn, _group_path(module, mod_name)
                continue
            if param in _REPLACED:  # tied to a parameter sharded by an earlier call under another module
                sharded, info = _REPLACED[param]
            else:
                _check_param(fqn, param, mesh)
                sharded = _shard_param(param, mesh)
                info = ParamInfo(
                    fqn=fqn,
                    bucket=_group_path(module, mod_name),
                    dim0=param.shape[0],
                    world_size=world_size,
                    group_name=group_name,
                    param_dtype=mp_policy.param_dtype if mp_policy.param_dtype != param.dtype else None,
                    reduce_dtype=mp_policy.reduce_dtype or mp_policy.param_dtype or param.dtype,
                    reshard_after_forward=reshard_after_forward,
                    replicate_size=replicate_size,
                    replicate_group_name=replicate_group_name,
                )
                _REPLACED[param] = (sharded, info)
                param_fqns.append(fqn)
            mod._parameters[pname] = sharded
            new_infos[pname] = info
        if new_infos:
            _install_properties(mod, new_infos)

    _install_properties(module, {})  # the module gets ShardedModule's methods even without parameters of its own
    _register_mp_hooks(module, mp_policy)
    if reshard_after_forward:
        register_reshard_hooks(module)
    object.__setattr__(module, _STATE_ATTR, ShardState(tuple(param_fqns)))
    return module
