"""`shard(module, mesh)`: FSDP2's parameter layout, applied in place.

Every managed parameter becomes an `nn.Parameter` holding a `DTensor` sharded on dim 0 (`Shard(0)`, uneven
rows follow `torch.chunk`, so a rank's shard may be empty). The module's class is swapped for a subclass with
one property per managed parameter name, so that `module.weight` returns `unshard(shard)` — the gathered
parameter, eager-correct and traceable — while `named_parameters()` / `state_dict()` keep the original names and
show the sharded DTensors with their logical shapes.

HSDP: on a 2-D mesh `(replicate, shard)` parameters are `DTensor [Replicate(), Shard(0)]`: sharded over the
mesh's last dim, replicated over its first; gradients are reduce-scattered, then all-reduced over the replicas.

FSDP + tensor parallelism: a parameter that is already a DTensor on a 1-D TP mesh (from `parallelize_module`)
keeps its TP layout and is sharded over the dp mesh on top, as FSDP2 does: a DTensor on the concatenated (dp, tp)
mesh, `[Shard(0) | _StridedShard(0) when TP also shards dim 0, *tp placements]`. `module.weight` gathers over dp
and returns the TP DTensor, so TP's own collectives (DTensor redistribution) trace into the same graph.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ._torch_private import concatenate_meshes, root_mesh_groups, strided_shard
from .comm_groups import fsdp_group
from .config import MixedPrecisionPolicy
from .cost_model import measure_profile
from .eager_reshard import note_gathered, register_reshard_hooks
from .ops import unshard

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

_STATE_ATTR = "_fsdp2_state"


@dataclass(frozen=True)
class TPLayout:
    """A tensor-parallel parameter's DTensor layout before `shard`: what the gathered TP-local tensor is wrapped
    back into for the module's forward."""

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]

    def wrap(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride)


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
    tp: TPLayout | None = None
    """FSDP + TP: the parameter's tensor-parallel layout (`dim0` is then its TP-local dim 0)."""
    prefetch_forward: tuple[ParamInfo, ...] = field(default=(), repr=False, compare=False)
    """One parameter of each group to prefetch when this one's group is used in forward (`set_modules_to_forward_
    prefetch`); their buckets are read when the graph is traced, after every `shard` call has named them."""
    prefetch_backward: tuple[ParamInfo, ...] = field(default=(), repr=False, compare=False)
    grad_divide_factor: float = 0.0
    """`set_gradient_divide_factor`: gradients are multiplied by 1 / it on each rank and summed (0: averaged)."""
    requires_all_reduce: bool = True
    """HSDP: False keeps the reduce-scattered gradient on this rank instead of all-reducing it over the replicas."""
    partial_key: str = ""
    """Where those partial gradients are kept; set the first time the all-reduce is turned off."""

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
        return full if self.tp is None else self.tp.wrap(full)

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
            ",".join(i.bucket for i in self.prefetch_forward),
            ",".join(i.bucket for i in self.prefetch_backward),
            self.grad_divide_factor,
            self.requires_all_reduce,
            self.partial_key,
        )

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self.requires_gradient_sync = requires_gradient_sync
        if not requires_gradient_sync and not self.pending_key:
            self.pending_key = f"{self.fqn}@{id(self):x}"


@dataclass(frozen=True, eq=False)
class ShardState:
    """Recorded on every module passed to one `shard` call (one FSDP2 parameter group: a module, or a list of
    modules sharded together); each parameter's own facts are in its `ParamInfo`."""

    infos: tuple[ParamInfo, ...]
    """The parameters this call took over."""
    members: tuple[weakref.ref, ...]
    """The modules of the call; the first one's path names the group's bucket."""
    mp_policy: MixedPrecisionPolicy


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
    if not isinstance(mesh, DeviceMesh):
        hint = (
            "; wrap it: DeviceMesh.from_group(group, device_type)"
            if isinstance(mesh, torch.distributed.ProcessGroup) else ""
        )
        raise TypeError(f"fsdp2_compile.shard: mesh must be a DeviceMesh or None, got {type(mesh).__name__}{hint}")
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
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 2 and "shard" in names[0] and "replicate" in names[1]:
        raise ValueError(
            f"fsdp2_compile.shard got a 2-D mesh named {names}: like fully_shard, HSDP reads the dims by position, "
            f"replicate first, then shard, so this mesh would shard over {names[1]!r}. Create it as "
            f'init_device_mesh(device_type, ({mesh.size(1)}, {mesh.size(0)}), mesh_dim_names=("replicate", "shard"))'
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
        _check_tp_param(fqn, param, mesh)


def _mesh_desc(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names
    dims = ", ".join(f"{n}={k}" for n, k in zip(names, mesh.shape)) if names else f"unnamed, shape {tuple(mesh.shape)}"
    return f"mesh ({dims})"


_RECIPE = (
    "slice both from one mesh: mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), "
    "parallelize_module(block, mesh['tp'], plan), then shard(block, mesh['dp'])"
)


def _check_tp_param(fqn: str, param: DTensor, mesh: DeviceMesh) -> None:
    """A DTensor parameter must be tensor-parallel (Shard / Replicate) on a 1-D mesh that `mesh` extends: both
    slices of one mesh over the same ranks, with disjoint dims. Checked on every rank before any collective (the
    checks read only the meshes' layouts, which every rank holds whole)."""
    tp_mesh = param.device_mesh
    where = f"parameter '{fqn}' is a DTensor on the tensor-parallel {_mesh_desc(tp_mesh)}"
    dp = f"shard's {_mesh_desc(mesh)}"
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"{where} with placements {tuple(param.placements)}: a {tp_mesh.ndim}-D mesh. fsdp2_compile shards over "
            f"{dp} on top of 1-D tensor parallelism only; apply the TP plan on one 1-D slice, e.g. mesh['tp']"
        )
    if any(p.is_partial() for p in param.placements):
        raise ValueError(
            f"{where} with placements {tuple(param.placements)}: a Partial (pending-reduction) parameter cannot be "
            f"sharded over {dp}; parameters must be Shard or Replicate (redistribute it, or let parallelize_module "
            "place it)"
        )
    if not mesh.mesh_dim_names or not tp_mesh.mesh_dim_names:
        raise ValueError(
            f"{where}, and {dp}" + (" (the default 1-D mesh over every rank)" if not mesh.mesh_dim_names else "")
            + f" has no dim names: with tensor parallelism {_RECIPE}"
        )
    same = set(tp_mesh.mesh_dim_names) & set(mesh.mesh_dim_names)
    if same:
        raise ValueError(
            f"{where}, and {dp} has the same dim {sorted(same)}: pass the data-parallel mesh, e.g. "
            f"shard(module, mesh['dp']) with the tensor-parallel plan applied on mesh['tp']"
        )
    try:
        concatenate_meshes([mesh, tp_mesh])
    except RuntimeError as e:
        why = (
            "they are meshes over different ranks"
            if "different device mesh" in str(e)
            else "they overlap: some ranks of one data-parallel group are also in one tensor-parallel group"
        )
        raise ValueError(f"{where}, which {dp} does not extend ({why}); {_RECIPE}") from None


def _shard_param(param: nn.Parameter, mesh: DeviceMesh) -> nn.Parameter:
    """Rows of this rank's shard on the mesh's last (shard) dim; replicated over a 2-D mesh's first dim. A
    tensor-parallel DTensor: its TP-local tensor's rows, on the (dp, tp) mesh (see the module docstring)."""
    world_size, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    data = param.detach().to_local() if isinstance(param, DTensor) else param.detach()
    chunks = torch.chunk(data, world_size, dim=0)
    local = chunks[rank] if rank < len(chunks) else data.new_empty((0, *data.shape[1:]))
    dp = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    on = mesh
    if isinstance(param, DTensor):
        tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
        if tp_placements[0].is_shard(0):  # TP's row blocks are split again by dp: strided, as FSDP2 places them
            dp[-1] = strided_shard(0, tp_mesh.size())
        dp, on = [*dp, *tp_placements], concatenate_meshes([mesh, tp_mesh])
    dtensor = DTensor.from_local(local.clone(), on, dp, run_check=False, shape=param.shape, stride=param.stride())
    return nn.Parameter(dtensor, requires_grad=param.requires_grad)


def _tp_layout(param: nn.Parameter) -> TPLayout | None:
    if not isinstance(param, DTensor):
        return None
    return TPLayout(param.device_mesh, tuple(param.placements), param.shape, param.stride())


def _check_bool(method: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{method}({name}={value!r}): use True or False")


class UnshardHandle:
    """What `FSDPModule.unshard(async_op=True)` returns; `wait()` returns at once (see `unshard`)."""

    def wait(self) -> None:
        return None


class FSDPModule:
    """The class every module passed to `shard` gets mixed in (`isinstance(m, FSDPModule)`), with FSDP2's methods
    of the same names and meanings. Settings that change the compiled graph (gradient sync, resharding after
    forward) are read while Dynamo traces, so a change after compilation recompiles (Dynamo guards on them) and,
    set alike on every rank, the ranks agree."""

    def _param_infos(self, recurse: bool) -> list[ParamInfo]:
        modules = [m for m in self.modules() if is_sharded(m)] if recurse else [self]
        return list({id(i): i for m in modules for i in _state(m).infos}.values())

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's gradient-accumulation switch. False: backward reduces no gradient; each rank keeps the
        unsharded gradients of this module's parameters (their `.grad` gets zeros), and the next backward with
        sync on adds them before the reduce-scatter, so micro-batches with sync off, then one with it on, equal
        one large batch. `recurse=False`: only the parameters of this module's own `shard` call."""
        _check_bool("set_requires_gradient_sync", "requires_gradient_sync", requires_gradient_sync)
        for info in self._param_infos(recurse):
            info.set_requires_gradient_sync(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """True: forward frees each gathered parameter after use and backward gathers it again; False: forward
        keeps it for backward (no second all-gather, more memory)."""
        _check_bool("set_reshard_after_forward", "reshard_after_forward", reshard_after_forward)
        for info in self._param_infos(recurse):
            info.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Only True (FSDP2's default): each compiled forward gathers its parameters inside its own graph, so
        nothing gathered outlives a backward."""
        _check_bool("set_reshard_after_backward", "reshard_after_backward", reshard_after_backward)
        if not reshard_after_backward:
            raise NotImplementedError(
                f"{type(self).__name__}.set_reshard_after_backward(False) is not supported by fsdp2_compile: every "
                "compiled forward gathers its parameters inside its graph, so keeping them after backward saves "
                "nothing. Leave it True; for gradient accumulation use set_requires_gradient_sync(False)"
            )

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility with FSDP2-equal results: every compiled backward waits for its own
        reductions before it returns, which is what FSDP2 does on the last backward."""
        _check_bool("set_is_last_backward", "is_last_backward", is_last_backward)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP gradient accumulation with reduce-scatter only: False keeps each backward's reduce-scattered
        gradient on this rank (the parameters' `.grad` get zeros), and the next backward with the all-reduce adds
        them before all-reducing over the replicas. No effect on a 1-D mesh."""
        _check_bool("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce)
        for info in self._param_infos(recurse):
            info.requires_all_reduce = requires_all_reduce
            if not requires_all_reduce and not info.partial_key:
                info.partial_key = f"{info.fqn}@{id(info):x}/partial"

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This module's group (not its children's, as in FSDP2): each rank's gradient is multiplied by 1 / factor
        and the results are summed over the data-parallel ranks (reduce-scatter, then the HSDP all-reduce),
        instead of averaged; a factor equal to the shard group's size on a 1-D mesh is the default average."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"{type(self).__name__}.set_gradient_divide_factor({factor!r}): use a positive number")
        for info in self._param_infos(recurse=False):
            default = info.replicate_size == 1 and factor == info.world_size
            info.grad_divide_factor = 0.0 if default else float(factor)

    set_reduce_scatter_divide_factor = set_gradient_divide_factor

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In forward, issue the all-gathers of `modules`' groups right before this module's group is used (the
        scheduler places the others itself; explicit ones take precedence and ignore the memory budget)."""
        targets = self._prefetch_targets("set_modules_to_forward_prefetch", modules)
        for info in self._param_infos(recurse=False):
            info.prefetch_forward = targets

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In backward, issue the all-gathers of `modules`' groups right before this module's group is used."""
        targets = self._prefetch_targets("set_modules_to_backward_prefetch", modules)
        for info in self._param_infos(recurse=False):
            info.prefetch_backward = targets

    def _prefetch_targets(self, method: str, modules: object) -> tuple[ParamInfo, ...]:
        if not isinstance(modules, (list, tuple)):
            raise TypeError(f"{type(self).__name__}.{method}(modules) takes a list of modules, got {type(modules).__name__}")
        for i, m in enumerate(modules):
            if not isinstance(m, FSDPModule):
                raise TypeError(
                    f"{type(self).__name__}.{method}: modules[{i}] ({type(m).__name__}) was not passed to "
                    "fsdp2_compile.shard; only sharded modules have all-gathers to prefetch"
                )
        return tuple(_state(m).infos[0] for m in modules if _state(m).infos)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """FSDP2-equal results without a separate gather: reading `module.weight` outside a compiled forward
        always returns the gathered parameter, and compiled graphs gather (prefetched) inside themselves."""
        _check_bool("unshard", "async_op", async_op)
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Nothing stays gathered between steps (see `unshard`), so there is nothing to free."""


def _install_properties(module: nn.Module, infos: dict[str, ParamInfo], fsdp_module: bool = False) -> None:
    """Swap `module`'s class for a subclass of it whose `name` attributes return the gathered parameters; with
    `fsdp_module` (a module `shard` was called on) the subclass also derives from `FSDPModule`."""
    cls = type(module)
    base = cls.__bases__[0] if getattr(cls, "_fsdp2_generated", False) else cls
    existing = dict(getattr(cls, "_fsdp2_infos", {}))
    existing.update(infos)

    def make(name: str, info: ParamInfo) -> property:
        return property(lambda self: info.gather(self._parameters[name]))

    namespace = {name: make(name, info) for name, info in existing.items()}
    namespace.update(_fsdp2_generated=True, _fsdp2_infos=existing, __module__=base.__module__)
    bases = (base, FSDPModule) if fsdp_module or isinstance(module, FSDPModule) else (base,)
    module.__class__ = type(f"Sharded{base.__name__}", bases, namespace)


def _state(module: nn.Module) -> ShardState:
    return getattr(module, _STATE_ATTR)


def _group_path(root: nn.Module, mod_name: str, paths: dict[int, str]) -> str:
    """The bucket of a parameter of `root.get_submodule(mod_name)`: the path of the nearest module at or above it
    that `shard` was called on ("" = root); for a list of modules sharded together, the path of the first
    (`paths`: id(module) -> path under `root`)."""
    parts = mod_name.split(".") if mod_name else []
    for end in range(len(parts), 0, -1):
        path = ".".join(parts[:end])
        mod = root.get_submodule(path)
        if is_sharded(mod):
            leader = _state(mod).members[0]()
            return paths.get(id(leader), path)
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
    module: nn.Module | list[nn.Module],
    mesh: DeviceMesh | None = None,
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    ignored_params: Iterable[nn.Parameter] | None = None,
    offload_policy: object = None,
) -> nn.Module | list[nn.Module]:
    """Shard `module`'s parameters on dim 0 over `mesh`, in place, like FSDP2's `fully_shard`.

    Call it on each block first and on the root last: parameters already taken over by an earlier call stay in
    that call's group. A list of modules (e.g. `[model.norm, model.output]`) is one group: one all-gather and one
    reduce-scatter for all of them. Like `fully_shard`, it is collective: every rank of the mesh must call it (the
    first call on a process group measures the link and compute speed for the scheduler, agreed across ranks).
    `mesh=None` means a 1-D mesh over the default process group. Parameters in `ignored_params` are left as they
    are (not sharded, not gathered, their gradients not reduced). Every module given becomes an `FSDPModule`.
    `offload_policy`: torch's `OffloadPolicy()` (no offload) is accepted; `CPUOffloadPolicy` is not supported yet.
    Returns `module`.
    """
    members = _check_modules(module)
    _check_options(reshard_after_forward, mp_policy, offload_policy)
    mesh = _default_mesh(mesh)
    ignored = _check_ignored(ignored_params)
    _check_new_params(members, mesh, ignored)  # on every rank, before any collective
    world_size, group_name, replicate_size, replicate_group_name = _mesh_groups(mesh)
    if world_size > 1 and torch.distributed.get_backend(mesh.get_group(mesh.ndim - 1)) != "fake":
        # for the scheduler's cost model; measured once per process group, agreed over the whole mesh
        measure_profile(group_name, world_size, mesh.device_type, agree_over=root_mesh_groups(mesh))
    for p in ignored.values():
        setattr(p, _IGNORED_ATTR, True)
    _install_optimizer_check()

    taken: list[ParamInfo] = []
    for member in members:
        _warn_on_mixed_param_dtypes(member, mp_policy)
        paths = {id(m): name for name, m in member.named_modules(remove_duplicate=False)}
        for mod_name, mod in member.named_modules(remove_duplicate=False):
            new_infos: dict[str, ParamInfo] = {}
            for pname, param in list(mod._parameters.items()):
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                if param is None or id(param) in ignored:
                    continue
                known = _infos(mod).get(pname)
                if known is not None and isinstance(param, DTensor):  # taken over by an earlier call: rename only
                    known.fqn, known.bucket = fqn, _group_path(member, mod_name, paths)
                    continue
                if param in _REPLACED:  # tied to a parameter sharded by an earlier call under another module
                    sharded, info = _REPLACED[param]
                else:
                    _check_param(fqn, param, mesh)
                    sharded = _shard_param(param, mesh)
                    tp = _tp_layout(param)
                    info = ParamInfo(
                        fqn=fqn,
                        bucket=_group_path(member, mod_name, paths),
                        dim0=param.to_local().shape[0] if tp is not None else param.shape[0],
                        world_size=world_size,
                        group_name=group_name,
                        param_dtype=mp_policy.param_dtype if mp_policy.param_dtype != param.dtype else None,
                        reduce_dtype=mp_policy.reduce_dtype or mp_policy.param_dtype or param.dtype,
                        reshard_after_forward=reshard_after_forward,
                        replicate_size=replicate_size,
                        replicate_group_name=replicate_group_name,
                        tp=tp,
                    )
                    _REPLACED[param] = (sharded, info)
                    taken.append(info)
                mod._parameters[pname] = sharded
                new_infos[pname] = info
            if new_infos:
                _install_properties(mod, new_infos)
        _cast_buffers(member, mp_policy.buffer_dtype)

    state = ShardState(tuple(taken), tuple(weakref.ref(m) for m in members), mp_policy)
    for member in members:
        _install_properties(member, {}, fsdp_module=True)
        _register_mp_hooks(member, mp_policy)
        register_reshard_hooks(member)  # acts only on parameters gathered with reshard_after_forward on
        object.__setattr__(member, _STATE_ATTR, state)
    return module


def _check_new_params(members: list[nn.Module], mesh: DeviceMesh, ignored: dict[int, nn.Parameter]) -> None:
    """`_check_param` on every parameter this `shard` call will take over (not ignored, not taken by an earlier
    call), before `shard` measures the link or creates any group: bad input fails on every rank alike."""
    for member in members:
        for mod_name, mod in member.named_modules(remove_duplicate=False):
            for pname, param in mod._parameters.items():
                if param is None or id(param) in ignored or pname in _infos(mod) or param in _REPLACED:
                    continue
                _check_param(f"{mod_name}.{pname}" if mod_name else pname, param, mesh)


def _check_modules(module: object) -> list[nn.Module]:
    """The modules of one `shard` call: a module, or a non-empty list / tuple of distinct modules, none sharded."""
    members = list(module) if isinstance(module, (list, tuple)) else [module]
    if not members:
        raise ValueError("fsdp2_compile.shard got an empty list of modules; pass a module or a list of modules")
    for i, m in enumerate(members):
        where = f"[{i}] " if isinstance(module, (list, tuple)) else ""
        if not isinstance(m, nn.Module):
            raise TypeError(f"fsdp2_compile.shard: module {where}is a {type(m).__name__}, not an nn.Module")
        if is_sharded(m):
            raise ValueError(
                f"module {where}{type(m).__name__} is already sharded by fsdp2_compile.shard; call shard once per module"
            )
    if len({id(m) for m in members}) != len(members):
        raise ValueError("fsdp2_compile.shard got the same module twice in its list; list each module once")
    return members


def _check_options(reshard_after_forward: object, mp_policy: object, offload_policy: object = None) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if isinstance(offload_policy, CPUOffloadPolicy):
        raise NotImplementedError(
            "shard(offload_policy=CPUOffloadPolicy()) is not supported by fsdp2_compile yet: sharded parameters, "
            "gradients and optimizer state stay on the mesh's device (on a CPU mesh they are on the CPU already)"
        )
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"shard(offload_policy=...) takes torch.distributed.fsdp.OffloadPolicy(), got {type(offload_policy).__name__}"
        )
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"shard(reshard_after_forward={reshard_after_forward}): FSDP2's int form (reshard to a smaller group "
            "after forward) is not supported by fsdp2_compile; use True (gather again in backward) or False (keep "
            "the gathered parameters from forward to backward)"
        )
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"shard(reshard_after_forward={reshard_after_forward!r}): use True or False")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"shard(mp_policy=...) must be a fsdp2_compile.MixedPrecisionPolicy, got {type(mp_policy).__name__}"
        )


def _check_ignored(ignored_params: Iterable[nn.Parameter] | None) -> dict[int, nn.Parameter]:
    if ignored_params is None:
        return {}
    if isinstance(ignored_params, (torch.Tensor, nn.Module)):
        raise TypeError(
            f"shard(ignored_params=...) got a single {type(ignored_params).__name__}; pass a set of parameters, "
            "e.g. set(module.parameters())"
        )
    params = list(ignored_params)
    for i, p in enumerate(params):
        if not isinstance(p, nn.Parameter):
            hint = "; pass its parameters: set(module.parameters())" if isinstance(p, nn.Module) else ""
            raise TypeError(f"shard(ignored_params=...): item {i} is a {type(p).__name__}, not an nn.Parameter{hint}")
    return {id(p): p for p in params}


def _warn_on_mixed_param_dtypes(module: nn.Module, mp: MixedPrecisionPolicy) -> None:
    """Groups sharded earlier under `module` with another param_dtype hand each other activations of different
    dtypes (FSDP2 behaves the same); the usual cause is an mp_policy passed to the root's call only."""
    others = sorted(
        name for name, m in module.named_modules()
        if name and is_sharded(m) and _state(m).mp_policy.param_dtype != mp.param_dtype
    )
    if others:
        theirs = _state(module.get_submodule(others[0])).mp_policy.param_dtype
        warnings.warn(
            f"fsdp2_compile.shard: {type(module).__name__} is sharded with param_dtype={mp.param_dtype} but "
            f"{', '.join(others[:4])}{' ...' if len(others) > 4 else ''} were sharded with param_dtype={theirs}: their "
            "activations will meet in different dtypes. Pass the same mp_policy to every shard call "
            "(blocks and root), as with fully_shard",
            stacklevel=3,
        )


def _cast_buffers(module: nn.Module, dtype: torch.dtype | None) -> None:
    """`MixedPrecisionPolicy.buffer_dtype`: floating buffers of `module` outside groups sharded earlier, in place."""
    if dtype is None:
        return
    for name, mod in module.named_modules():
        if name and any(is_sharded(a) for a in _ancestors(module, name)):
            continue
        for bname, buf in mod._buffers.items():
            if buf is not None and buf.is_floating_point():
                mod._buffers[bname] = buf.to(dtype)


def _ancestors(root: nn.Module, name: str) -> list[nn.Module]:
    """The modules on the path from `root` (excluded) down to `root.get_submodule(name)` (included)."""
    parts = name.split(".")
    return [root.get_submodule(".".join(parts[:end])) for end in range(1, len(parts) + 1)]


_CHECKED_OPTIMIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Optimizer -> number of param groups already checked by `_check_optimizer`."""
_OPTIMIZER_HOOK: list = []


def _install_optimizer_check() -> None:
    """Once per process: before an optimizer's first step (and after param groups are added), refuse one that
    holds parameters `shard` replaced: it would update tensors the sharded model no longer uses."""
    if not _OPTIMIZER_HOOK:
        _OPTIMIZER_HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


def _check_optimizer(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    groups = len(optimizer.param_groups)
    if _CHECKED_OPTIMIZERS.get(optimizer) == groups:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in _REPLACED:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameter '{_REPLACED[p][1].fqn}' as it was before "
                    "fsdp2_compile.shard replaced it with a sharded DTensor parameter, so it would train nothing. "
                    "Build the optimizer after shard / shard_compile, e.g. "
                    f"torch.optim.{type(optimizer).__name__}(model.parameters(), ...)"
                )
    _CHECKED_OPTIMIZERS[optimizer] = groups
