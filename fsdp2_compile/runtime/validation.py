"""What `shard` refuses, and why: every check runs on every rank before any collective, and names the module,
parameter or argument and what to do. Also the optimizer check (an optimizer built before `shard`), run by the
step pre-hook `shard` registers while sharded modules live."""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import fsdp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fsdp2_compile._torch_private import concatenate_meshes, own_parameters
from fsdp2_compile.config import MixedPrecisionPolicy
from fsdp2_compile.core.ops import pending_grad_keys
from fsdp2_compile.runtime.float8 import float8_cast_of, high_precision
from fsdp2_compile.runtime.param_state import (
    REPLACED,
    infos_of,
    infos_of_values,
    is_known_param,
    is_sharded,
    state_of,
)
from fsdp2_compile.runtime.rank_agreement import agree_to_shard

__all__ = [
    "check_ignored",
    "check_no_aliases",
    "check_same_call",
    "check_same_values",
    "check_no_unsynced_grads",
    "check_modules",
    "check_new_params",
    "check_optimizer",
    "check_options",
    "default_device_type",
    "resolve_mesh",
    "warn_on_mixed_param_dtypes",
]


def default_device_type() -> str:
    """The device type of the default process group's mesh: the CPU without a process group, for gloo, or without a
    usable accelerator (a CUDA build of torch on a machine without a GPU has an accelerator type but none
    available)."""
    if (
        not torch.distributed.is_initialized()
        or torch.distributed.get_backend() == "gloo"
        or not torch.accelerator.is_available()
    ):
        return "cpu"
    return torch.accelerator.current_accelerator().type


def resolve_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
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
            if isinstance(mesh, torch.distributed.ProcessGroup)
            else ""
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


def _check_param(fqn: str, param: nn.Parameter, mesh: DeviceMesh, offload: bool) -> None:
    if param.dim() == 0:
        raise ValueError(
            f"parameter '{fqn}' is 0-dimensional; FSDP shards parameters on dim 0. "
            "Give it shape (1,) or pass it in ignored_params"
        )
    if param.device.type not in (mesh.device_type, "meta", *(("cpu",) if offload else ())):
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
            f"{where}, and {dp}"
            + (" (the default 1-D mesh over every rank)" if not mesh.mesh_dim_names else "")
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


def check_new_params(
    members: list[nn.Module],
    mesh: DeviceMesh,
    ignored: dict[int, nn.Parameter],
    offload: bool = False,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
) -> dict[int, int]:
    """`_check_param` on every parameter this `shard` call will take over (not ignored, not taken by an earlier
    call), before `shard` checks the initial weights or creates any group: bad input fails on every rank alike. With CPU
    offload, parameters may be on the CPU whatever the mesh's device. Returns the dim each is sharded on, by id
    (`shard_placement_fn`'s `Shard(dim)`, else 0)."""
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            f"shard(shard_placement_fn=...) takes a function of a parameter returning Shard(dim) or None, got "
            f"{type(shard_placement_fn).__name__}"
        )
    _check_no_sparse_grads(members, ignored)
    dims = {}
    for fqn, param in _params_to_take(members, ignored):
        _check_param(fqn, param, mesh, offload)
        if shard_placement_fn is not None:
            dims[id(param)] = _shard_dim(fqn, param, shard_placement_fn(param))
        if float8_cast_of(fqn, param) is not None:
            _check_float8_param(fqn, param, dims.get(id(param), 0), offload)
    return dims


def _check_no_sparse_grads(members: list[nn.Module], ignored: dict[int, nn.Parameter]) -> None:
    """An embedding with `sparse=True` gives its weight a sparse gradient, which no reduce-scatter takes."""
    for member in members:
        for name, mod in member.named_modules():
            sparse = isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse
            if sparse and id(own_parameters(mod).get("weight")) not in ignored:  # not mod.weight: a gather once sharded
                raise ValueError(
                    f"module '{name or type(member).__name__}' ({type(mod).__name__}) has sparse=True: its weight's "
                    "gradient is a sparse tensor, which cannot be reduce-scattered (nor can fully_shard's). Build it "
                    "with sparse=False, or pass its weight in ignored_params to keep it whole on every rank"
                )


def _params_to_take(members: list[nn.Module], ignored: dict[int, nn.Parameter]) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) under every name of each parameter this `shard` call takes over: not in `ignored`, not
    taken or replaced by an earlier call."""
    for member in members:
        for mod_name, mod in member.named_modules(remove_duplicate=False):
            for pname, param in own_parameters(mod).items():
                if param is None or id(param) in ignored or pname in infos_of(mod) or param in REPLACED:
                    continue
                yield (f"{mod_name}.{pname}" if mod_name else pname), param


def _check_float8_param(fqn: str, param: nn.Parameter, dim: int, offload: bool) -> None:
    """A torchao float8 weight is gathered as float8 (`float8.py`) on dim 0, without TP or CPU offload."""
    unsupported = (
        "tensor parallelism"
        if isinstance(param, DTensor)
        else f"Shard({dim})"
        if dim
        else "CPU offload"
        if offload
        else ""
    )
    if unsupported:
        raise ValueError(
            f"parameter '{fqn}' is a torchao float8 weight gathered as float8 (enable_fsdp_float8_all_gather=True), "
            f"which fsdp2_compile does not do with {unsupported}: convert with enable_fsdp_float8_all_gather=False "
            "(the weight is gathered in high precision and cast after), or leave out that option"
        )


def _shard_dim(fqn: str, param: nn.Parameter, placement: object) -> int:
    """The dim `shard_placement_fn` chose for `param` (None: 0), checked: a `Shard` of a dim the parameter has."""
    if placement is None:
        return 0
    if type(placement) is not Shard:
        raise TypeError(
            f"shard_placement_fn returned {placement!r} for parameter '{fqn}': return Shard(dim) or None (Shard(0))"
        )
    dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.ndim:
        raise ValueError(
            f"shard_placement_fn returned Shard({placement.dim}) for parameter '{fqn}' of shape {tuple(param.shape)}, "
            f"which has no dim {placement.dim}: return Shard(d) for 0 <= d < {param.ndim}, or None"
        )
    return dim


def check_modules(module: object) -> list[nn.Module]:
    """The modules of one `shard` call: a module, or a non-empty list / tuple of distinct modules, none sharded, none
    holding a module `fully_shard` sharded."""
    members = list(module) if isinstance(module, (list, tuple)) else [module]
    if not members:
        raise ValueError("fsdp2_compile.shard got an empty list of modules; pass a module or a list of modules")
    for i, m in enumerate(members):
        where = f"[{i}] " if isinstance(module, (list, tuple)) else ""
        if not isinstance(m, nn.Module):
            raise TypeError(f"fsdp2_compile.shard: module {where}is a {type(m).__name__}, not an nn.Module")
        if is_sharded(m):
            raise ValueError(
                f"module {where}{type(m).__name__} is already sharded by fsdp2_compile.shard; call shard once per "
                'module (to compile a model whose root is sharded already: torch.compile(model, backend="fsdp2"))'
            )
    if len({id(m) for m in members}) != len(members):
        raise ValueError("fsdp2_compile.shard got the same module twice in its list; list each module once")
    for i, m in enumerate(members):
        where = f"[{i}] " if isinstance(module, (list, tuple)) else ""
        for name, sub in m.named_modules():
            if isinstance(sub, fsdp.FSDPModule) and not is_sharded(sub):
                what = f"'s submodule '{name}' ({type(sub).__name__})" if name else ""
                raise ValueError(
                    f"fsdp2_compile.shard: module {where}{type(m).__name__}{what} was sharded by torch's fully_shard; "
                    "fully_shard and fsdp2_compile.shard cannot shard parts of one model. Build the model again and "
                    "call fsdp2_compile.shard where you called fully_shard (blocks first, then the root)"
                )
    return members


def check_options(mp_policy: object, offload_policy: object = None) -> None:
    from torch.distributed.fsdp import OffloadPolicy

    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"shard(offload_policy=...) takes torch.distributed.fsdp.OffloadPolicy(), got {type(offload_policy).__name__}"
        )
    MixedPrecisionPolicy.of(mp_policy)  # ours or torch's, else a TypeError naming both


def check_ignored(ignored_params: Iterable[nn.Parameter] | None, members: list[nn.Module]) -> dict[int, nn.Parameter]:
    """`ignored_params` by id: parameters of the modules of this `shard` call (`members`)."""
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
    held = {id(p) for m in members for _, p in m.named_parameters(remove_duplicate=False)}
    outside = [i for i, p in enumerate(params) if id(p) not in held]
    if outside:
        p = params[outside[0]]
        raise ValueError(
            f"shard(ignored_params=...): item {outside[0]} (shape {tuple(p.shape)}) is not a parameter of "
            f"{' / '.join(type(m).__name__ for m in members)}: it would be ignored while the parameter you meant is "
            "sharded. Pass parameters of the modules this call shards (e.g. {model.head.weight}, taken after any "
            "copy or re-creation of the model)"
        )
    return {id(p): p for p in params}


def check_same_call(module: nn.Module | list[nn.Module], mesh: DeviceMesh) -> None:
    """Before `shard`'s first collective: every rank of `mesh` confirms through the store that it makes this call,
    named by the classes of its modules ("shard(Block)"), over the groups of the mesh's dims of more than one rank
    (`rank_agreement.agree_to_shard`). Every rank that came raises alike, naming the ranks that called `shard` on
    other modules (at once) or did not call it (after the bounded wait derived from the process group's timeout),
    where they would otherwise wait in the first collective until that timeout."""
    names = (
        type(module).__name__ if isinstance(module, nn.Module) else f"[{', '.join(type(m).__name__ for m in module)}]"
    )
    agree_to_shard(f"shard({names})", {mesh.get_group(d).group_name for d in range(mesh.ndim) if mesh.size(d) > 1})


def check_same_values(members: list[nn.Module], mesh: DeviceMesh, ignored: dict[int, nn.Parameter]) -> None:
    """Refuse parameters whose values differ between the ranks of `mesh` (different seeds, a rank that loaded
    another checkpoint): sharding would mix rows of each rank's model. Compares a checksum of each parameter
    this call will take over (its size, float64 sum and sum of squares), three all-reduces per mesh dim; every
    rank raises alike, naming the first parameter that differs. Parameters on the meta device have no values yet:
    skipped. The ranks must shard the same number of parameters (a model built differently per rank is named
    by the rank-consistency check when it compiles), so `shard` skips the check when they do not."""
    first_names: dict[int, tuple[str, nn.Parameter]] = {}
    for fqn, param in _params_to_take(members, ignored):
        if param.device.type != "meta":
            first_names.setdefault(id(param), (fqn, param))
    named = list(first_names.values())
    on_device = mesh.device_type != "cpu"
    device = torch.device(mesh.device_type, torch.accelerator.current_device_index()) if on_device else "cpu"
    counts = torch.tensor([len(named), -len(named)], dtype=torch.float64, device=device)
    for dim in range(mesh.ndim):
        dist.all_reduce(counts, dist.ReduceOp.MAX, group=mesh.get_group(dim))
    if counts[0] != -counts[1] or not named:
        return
    with torch.no_grad():
        sums = torch.stack(
            [
                torch.stack([x.new_tensor(x.numel()), x.sum(), x.square().sum()])
                for x in (
                    _real(high_precision(p.to_local() if isinstance(p, DTensor) else p)).double().nan_to_num()
                    for _, p in named
                )
            ]
        ).cpu()
    high, low = sums.to(device, copy=True), sums.to(device, copy=True)
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        dist.all_reduce(high, dist.ReduceOp.MAX, group=group)
        dist.all_reduce(low, dist.ReduceOp.MIN, group=group)
    differ = (high != low).any(dim=1).nonzero().flatten().tolist()
    if differ:
        name, _ = named[differ[0]]
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        what = "sizes" if high[differ[0], 0] != low[differ[0], 0] else "values"
        raise ValueError(
            f"parameter '{name}'{more} has different {what} on different ranks of the mesh: sharding would mix the "
            "rows of each rank's model. Build the model the same way on every rank (torch.manual_seed(...) before "
            "creating it) or load the same checkpoint on every rank before shard, and shard the same modules in "
            "the same order on every rank (a rank that skipped one block's call compares its next block); or pass "
            "check_same_init=False to skip this check (one pass over the parameters and a few all-reduces per shard "
            "call)"
        )


def _real(x: torch.Tensor) -> torch.Tensor:
    """`x` detached, a complex tensor viewed as its real and imaginary parts (both count in a checksum)."""
    x = x.detach()
    return torch.view_as_real(x) if x.is_complex() else x


def check_no_aliases(members: list[nn.Module], ignored: dict[int, nn.Parameter]) -> None:
    """Refuse two parameters that share memory without being one parameter (a view of another, e.g.
    `nn.Parameter(other.weight[:4])` or `.T`): each would be sharded and trained as a tensor of its own, and they
    would no longer agree after one step."""
    spans: dict[tuple, list[tuple[int, int, str]]] = {}  # storage -> (first byte, end byte, name) of each parameter
    seen: set[int] = set()
    for member in members:
        for name, param in member.named_parameters(remove_duplicate=True):
            if id(param) in seen or id(param) in ignored or isinstance(param, DTensor) or param.device.type == "meta":
                continue
            seen.add(id(param))
            param = high_precision(param)
            if not param.numel():
                continue
            storage = param.untyped_storage()
            first = param.storage_offset() * param.element_size()
            end = first + (1 + sum((n - 1) * s for n, s in zip(param.shape, param.stride()))) * param.element_size()
            known = spans.setdefault((storage.device, storage.data_ptr()), [])
            other = next((o for a, b, o in known if a < end and first < b), None)
            if other is not None:
                raise ValueError(
                    f"parameters '{other}' and '{name}' share memory (one is a view of the other) without being one "
                    "parameter: sharded, each would train on its own and they would differ after one step. Tie them "
                    "by assigning the same nn.Parameter to both attributes, or compute one from the other in forward, "
                    "or pass one in ignored_params"
                )
            known.append((first, end, name))


def warn_on_mixed_param_dtypes(module: nn.Module, mp: MixedPrecisionPolicy) -> None:
    """Groups sharded earlier under `module` with another param_dtype hand each other activations of different
    dtypes (FSDP2 behaves the same); the usual cause is an mp_policy passed to the root's call only."""
    others = sorted(
        name
        for name, m in module.named_modules()
        if name and is_sharded(m) and state_of(m).mp_policy.param_dtype != mp.param_dtype
    )
    if others:
        theirs = state_of(module.get_submodule(others[0])).mp_policy.param_dtype
        warnings.warn(
            f"fsdp2_compile.shard: {type(module).__name__} is sharded with param_dtype={mp.param_dtype} but "
            f"{', '.join(others[:4])}{' ...' if len(others) > 4 else ''} were sharded with param_dtype={theirs}: their "
            "activations will meet in different dtypes. Pass the same mp_policy to every shard call "
            "(blocks and root), as with fully_shard",
            stacklevel=3,
        )


_CHECKED_OPTIMIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Optimizer -> number of param groups already checked by `_check_optimizer`."""


def check_no_new_params(module: nn.Module) -> None:
    """At a compiled module's first call: every parameter is one `shard` took over or was told to ignore."""
    for name, param in module.named_parameters():
        owner, _, pname = name.rpartition(".")
        if not is_known_param(param) and pname not in infos_of(module.get_submodule(owner)):  # replaced: named later
            raise ValueError(
                f"parameter '{name}' of {type(module).__name__} was added after fsdp2_compile.shard: it is not sharded "
                "and its gradient would not be reduced over the ranks. Add it before calling shard / shard_compile (in ignored_params to keep "
                "it whole on every rank)"
            )


def check_no_unsynced_grads(optimizer: torch.optim.Optimizer) -> None:
    """Refuse a step while a parameter the optimizer holds has gradients kept unsharded by backwards with gradient
    sync off and never reduced: its `.grad` is zeros, so the step would change nothing (or only decay it)."""
    keys = pending_grad_keys()
    if not keys:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for info in infos_of_values(params):
        if info is not None and info.pending_key in keys:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(): parameter '{info.fqn}' has gradients that backwards with "
                "gradient sync off kept on this rank and never reduced, so its .grad holds zeros and the step would "
                "not train it. Turn sync back on before the last micro-batch's backward "
                "(model.set_requires_gradient_sync(True)); to drop them instead, call model.reset_iter_state()"
            )


def _modules_holding(param: nn.Parameter) -> list[str]:
    """ "<Class>.<name>" for each module that holds `param` as a parameter (looked up among all live objects, on
    this error path only)."""
    return [
        f"{type(m).__name__}.{name}"
        for m in gc.get_objects()
        if issubclass(type(m), nn.Module)
        for name, v in m.__dict__.get("_parameters", {}).items()
        if v is param
    ]


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Before an optimizer's first step (and after param groups are added), refuse one that holds parameters
    `shard` replaced: it would update tensors the sharded model no longer uses."""
    groups = len(optimizer.param_groups)
    if _CHECKED_OPTIMIZERS.get(optimizer) == groups:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in REPLACED:
                continue
            fqn = REPLACED[p][1].fqn
            if holders := _modules_holding(p):
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameter '{fqn}' as it was before fsdp2_compile.shard "
                    f"replaced it with a sharded DTensor parameter: {holders[0]}, a module outside the sharded one, "
                    "shares that parameter and still holds the unsharded tensor, so neither would train. Make that "
                    "module part of the sharded model (a submodule of it), then build the optimizer"
                )
            raise RuntimeError(
                f"{type(optimizer).__name__} holds parameter '{fqn}' as it was before fsdp2_compile.shard replaced "
                "it with a sharded DTensor parameter, so it would train nothing. Build the optimizer after shard / "
                f"shard_compile, e.g. torch.optim.{type(optimizer).__name__}(model.parameters(), ...)"
            )
    _CHECKED_OPTIMIZERS[optimizer] = groups
