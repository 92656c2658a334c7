"""The full model sharded at a layout (rank 0, the largest shard): what a plan takes from it (per-rank bytes,
buckets, each parameter's pipeline part and bytes), and the parameters' shapes the search derives the same figures
from at another dp split.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2_compile.core.ir import nbytes
from fsdp2_compile.planner.activation_checkpointing import has_checkpointing, unwrap_checkpointing
from fsdp2_compile.planner.block_sharding import shard_for_plan
from fsdp2_compile.planner.layout import Layout
from fsdp2_compile.planner.param_bytes import (
    ADAMW_STATES,
    _analytical_by_name,
    _bucket_numel,
    _itemsize,
    _resharded_sizes,
    _unique_params,
    analytical_bytes,
    sharded_bytes,
)
from fsdp2_compile.planner.reduced_depth import block_list, reduced_copy
from fsdp2_compile.planner.tensor_parallel import apply_tp, plan_text, tp_plan_for

__all__ = ["tokens_of"]


def tokens_of(args: tuple) -> int:
    """Tokens one rank processes per step: the elements of the first integer tensor input (token ids), else the
    rows of the first tensor input (all dims but the last)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for t in tensors:
        if not t.is_floating_point():
            return t.numel()
    return math.prod(tensors[0].shape[:-1]) if tensors else 1


@dataclass
class _FullModel:
    """What the plan takes from the full model sharded at the layout (rank 0, the largest shard)."""

    params: int
    """Unique parameters (numel)."""
    tokens: int
    """Tokens one rank processes per step."""
    block_path: str
    has_blocks: bool
    layers: int
    given_ac: bool
    """The factory's model is already checkpointed."""
    tp_plan: dict | None
    tp_text: str
    analytical: dict[str, float]
    measured: dict[str, int]
    numel: dict[str, int]
    """Full padded elements each bucket gathers (blocks, then the root "")."""
    buckets: dict[str, int]
    """Gathered bytes of each bucket, in the parameters' compute dtype."""
    resharded: dict[str, int]
    """Gathered bytes of the buckets resharded after forward, in their order of last use in forward."""
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    rows: list[_ParamRow] = field(default_factory=list)
    """Each managed parameter: its pipeline part, bucket and bytes."""
    local_batch: int = 1
    """Dim 0 of the factory's tensor inputs (what micro-batches split)."""
    facts: _ShardFacts | None = None
    """The parameters' shapes the figures above come from, for the same model at another dp split (the search)."""


@dataclass
class _ShardFacts:
    """The full model's parameters as the figures of `_FullModel` read them, independent of the dp split: each
    unique parameter (nbytes, tensor-parallel sharded, requires_grad, numel) before sharding, the same by name, and
    each managed parameter after it (`_ManagedFact`)."""

    unique: list[tuple[int, bool, bool, int]]
    named: list[tuple[str, int, bool, bool, int]]
    managed: list[_ManagedFact]
    float_dtype: torch.dtype
    """The first floating-point parameter's dtype (the compute dtype without a param_dtype)."""


@dataclass(frozen=True)
class _ManagedFact:
    name: str
    bucket: str
    dim0: int
    """The rows FSDP shards (TP-local under tensor parallelism)."""
    trailing: int
    """Elements per row of this rank's shard."""
    itemsize: int
    requires_grad: bool
    block: int | None
    """Index in the block list, None outside it."""
    linear: bool
    """A Linear's weight."""
    global_numel: int
    resharded: bool
    """Resharded after forward, as sharded for the facts."""


@dataclass
class _ParamRow:
    """One managed parameter of the full model, sharded at the layout (rank 0)."""

    part: int | str
    """The block index it belongs to, or "first" / "last" (used before / after the blocks in forward)."""
    bucket: str
    numel: int
    """Full padded elements its all-gather gathers."""
    gathered_bytes: int
    """Bytes gathered: numel x the compute dtype's size (float8 Linear weights: 1)."""
    local: dict[str, int]
    """This rank's bytes of parameter, gradient and AdamW state."""
    analytical: dict[str, float]


def _outside_parts(factory: Callable, call: Callable) -> dict[str, str]:
    """Each parameter outside the block list by name: "first" when its module runs before the first block in
    forward, else "last" (a 1-block copy run forward on meta; a parameter that never runs: "first")."""
    model, args, _, _ = reduced_copy(factory, 1, call)
    path, blocks = block_list(model)
    ran, parts, hooks = [False], {}, []
    hooks.append(blocks[0].register_forward_pre_hook(lambda *_: ran.__setitem__(0, True)))
    for name, module in model.named_modules():
        if name == path or name.startswith(f"{path}."):
            continue
        own = [n for n, _ in module.named_parameters(recurse=False)]

        def record(_module, _args, own=own, name=name):
            for n in own:
                parts.setdefault(f"{name}.{n}" if name else n, "last" if ran[0] else "first")

        if own:
            hooks.append(module.register_forward_pre_hook(record))
    with torch.no_grad():
        model.to("meta")(*args)
    for hook in hooks:
        hook.remove()
    return parts


def _param_rows(model, path: str, outside: dict[str, str], analytical: dict, itemsize: int, float8: bool):
    """`_ParamRow` of each managed parameter of the sharded `model` (block list at `path`)."""
    from fsdp2_compile.core.ops import padded_rows
    from fsdp2_compile.runtime.sharding import managed_params

    rows = []
    for name, p, info in managed_params(model):
        local = p.to_local() if isinstance(p, DTensor) else p
        numel = padded_rows(info.dim0, info.world_size) * info.world_size * math.prod(local.shape[1:])
        owner, _, attr = name.rpartition(".")
        in_block = path and name.startswith(f"{path}.")
        part = int(name[len(path) + 1 :].split(".")[0]) if in_block else outside.get(name, "first")
        linear = attr == "weight" and isinstance(model.get_submodule(owner), nn.Linear)
        size = 1 if float8 and in_block and linear else itemsize
        state = {
            "params": nbytes(local),
            "grads": nbytes(local) if p.requires_grad else 0,
            "optimizer": ADAMW_STATES * 4 * local.numel() if p.requires_grad else 0,
        }
        rows.append(_ParamRow(part, info.bucket, numel, numel * size, state, analytical[name]))
    return rows


def _shard_full_model(factory: Callable, layout: Layout, call: Callable, meshes: tuple, step: Callable) -> _FullModel:
    """Build the full model, apply the TP plan, shard it at the layout and take its per-rank bytes and buckets."""
    mesh, tp_mesh = meshes
    step("building the full model")
    model, full_args, _ = call(factory)
    path, blocks = block_list(model)
    given_ac = has_checkpointing(model)
    n_params = sum(p.numel() for p in _unique_params(model))
    tp_plan, tp_text = None, ""
    if tp_mesh is not None:
        unwrap_checkpointing(model)  # the plan names block-relative modules; checkpointing changes no shard
        if blocks is None:
            raise ValueError("--tp needs a model with an nn.ModuleList of blocks to apply the TP plan to")
        tp_plan, source = tp_plan_for(factory, blocks[0])
        tp_text = plan_text(tp_plan, source)
        step(f"applying {tp_text} on the tp mesh of {layout.tp} ranks")
        apply_tp(model, tp_mesh, tp_plan)
    analytical = analytical_bytes(model, layout.shard_size, layout.tp)
    by_name = _analytical_by_name(model, layout.shard_size, layout.tp)
    facts = _ShardFacts(
        [(nbytes(p), _tp_sharded(p), p.requires_grad, p.numel()) for p in _unique_params(model)],
        [(n, nbytes(p), _tp_sharded(p), p.requires_grad, p.numel()) for n, p in model.named_parameters()],
        [],
        next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32),
    )
    local_batch = _check_pipeline_fits(layout, full_args, path, blocks)
    outside = _outside_parts(factory, call) if layout.pp > 1 else {}
    mp_policy = layout.mp_policy
    param_dtype = mp_policy.param_dtype or next(
        (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32
    )
    replicate, shard_size = layout.replicate, layout.shard_size
    where = f"{layout.world_size} ranks" if mesh is None else f"a {replicate} x {shard_size} mesh (replicate x shard)"
    if tp_mesh is not None:
        where = f"dp ({shard_size} ranks" + (f" x {replicate} replicas" if replicate > 1 else "") + f"), tp {layout.tp}"
    step(f"sharding the full model over {where}")
    shard_for_plan(model, mesh=mesh, reshard_after_forward=layout.reshard_after_forward, mp_policy=mp_policy)
    numel = _bucket_numel(model)
    rows = _param_rows(
        model, path if blocks is not None else "", outside, by_name, _itemsize(param_dtype), layout.float8
    )
    buckets: dict[str, int] = {}
    for row in rows:
        buckets[row.bucket] = buckets.get(row.bucket, 0) + row.gathered_bytes
    facts.managed = _managed_facts(model, path if blocks is not None else "")
    return _FullModel(
        params=n_params,
        tokens=tokens_of(full_args),
        block_path=path,
        has_blocks=blocks is not None,
        layers=len(blocks) if blocks is not None else 0,
        given_ac=given_ac,
        tp_plan=tp_plan,
        tp_text=tp_text,
        analytical=analytical,
        measured=sharded_bytes(model),
        numel=numel,
        buckets={b: buckets[b] for b in numel},
        resharded=_resharded_sizes(model, _itemsize(param_dtype)),
        param_dtype=param_dtype,
        reduce_dtype=mp_policy.reduce_dtype or param_dtype,
        rows=rows,
        local_batch=local_batch,
        facts=facts,
    )


def _tp_sharded(p) -> bool:
    return isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)


def _managed_facts(model: nn.Module, path: str) -> list[_ManagedFact]:
    """`_ManagedFact` of each managed parameter of the sharded `model` (block list at `path`)."""
    from fsdp2_compile.runtime.sharding import managed_params

    facts = []
    for name, p, info in managed_params(model):
        local = p.to_local() if isinstance(p, DTensor) else p
        owner, _, attr = name.rpartition(".")
        in_block = bool(path) and name.startswith(f"{path}.")
        facts.append(
            _ManagedFact(
                name,
                info.bucket,
                info.dim0,
                math.prod(local.shape[1:]),
                local.element_size(),
                p.requires_grad,
                int(name[len(path) + 1 :].split(".")[0]) if in_block else None,
                attr == "weight" and isinstance(model.get_submodule(owner), nn.Linear),
                math.prod(p.shape),
                bool(info.reshard_after_forward),
            )
        )
    return facts


def _check_pipeline_fits(layout: Layout, args: tuple, path: str, blocks) -> int:
    """The local batch (dim 0 of the factory's tensor inputs); under pp, ValueError unless the model has a block
    list of at least P x V blocks and the micro-batches divide the local batch."""
    dims = {a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 0}
    local_batch = min(dims, default=1)
    if layout.pp == 1:
        return local_batch
    stages = layout.pp * layout.v
    if blocks is None:
        raise ValueError("--pp needs a model with an nn.ModuleList of blocks to split into pipeline stages")
    if stages > len(blocks):
        raise ValueError(
            f"--pp {layout.pp} x {layout.v} stage(s) per rank = {stages} stages, but '{path}' has {len(blocks)} "
            f"blocks: each stage needs a block; pass a smaller --pp or --stages-per-rank"
        )
    m = layout.microbatches or local_batch
    if len(dims) != 1 or local_batch % m:
        raise ValueError(
            f"--microbatches {m} does not divide the local batch: the factory's tensor inputs have dim 0 of "
            f"{sorted(dims)}; pass a --microbatches that divides {local_batch}, or a factory whose inputs share "
            "one batch dim"
        )
    return local_batch
