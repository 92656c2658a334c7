"""Tensor parallelism for the planner and the CLI (`--tp T`): the (dp, tp) mesh, the TP plan applied to each block
(the factory's own, or a default for Linear layers named like torchtitan's / Hugging Face's), a TP-local copy of a
model for the op-by-op trace, and the time of TP's collectives on the intra-node link.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp2_compile.planner.reduced_depth import block_list
from fsdp2_compile.runtime.sharding import default_device_type

__all__ = [
    "COLWISE_NAMES",
    "ROWWISE_NAMES",
    "TPPlan",
    "apply_tp",
    "default_tp_plan",
    "plan_meshes",
    "plan_text",
    "tp_collective_s",
    "tp_local_copy",
    "tp_plan_for",
]

COLWISE_NAMES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "gate_proj",
        "up_proj",
        "q",
        "k",
        "v",
        "gate",
        "up",
        "query",
        "key",
        "value",
        "wq",
        "wk",
        "wv",
        "w1",
        "w3",
        "c_fc",
        "fc1",
    }
)
"""Linear layers the default plan splits column-wise (output features): HF Llama / Mistral / Qwen, torchtitan."""
ROWWISE_NAMES = frozenset({"o_proj", "down_proj", "o", "down", "proj", "out_proj", "wo", "w2", "c_proj", "fc2"})
"""Linear layers the default plan splits row-wise (input features), after a column-wise one."""


# The plan: a dict of block-relative module names to `torch.distributed.tensor.parallel` styles, applied with
# `parallelize_module(block, mesh["tp"], plan)` to every block of the model's longest ModuleList, as torchtitan does.
# A factory gives its own with a `tp_plan` attribute (`factory.tp_plan = {...}`, or a callable taking the block and
# returning the dict); otherwise `default_tp_plan` pairs Linear layers by name: q/k/v/gate/up (and torchtitan's
# wq/wk/wv/w1/w3) column-wise, o/down/proj (wo/w2) row-wise: plain TP, one all-reduce of the activations per row-wise
# layer in forward and one per column-wise input in backward. Sequence parallelism (SequenceParallel norms,
# all-gather / reduce-scatter of the activations instead) comes with a factory's own plan; a factory's
# `tp_root_plan` (root-relative names outside the blocks, e.g. torchtitan's vocab-parallel embedding, sequence-parallel
# final norm and column-wise head) is applied to the root the same way.
class TPPlan(dict):
    """A block's TP plan (block-relative module names to styles) and, in `root`, the plan of the root's modules
    outside the blocks (root-relative names; empty: they stay whole)."""

    def __init__(self, blocks: dict, root: dict | None = None):
        super().__init__(blocks)
        self.root = dict(root or {})


def hsdp_mesh(world_size: int, replicate: int):
    """The 2-D mesh `(replicate, world_size // replicate)` with dims ("replicate", "shard") over the default process
    group; None for `replicate == 1` (shard() then uses its 1-D default mesh). Same device rule as that default."""
    if replicate == 1:
        return None
    if replicate < 1 or world_size % replicate:
        raise ValueError(f"world size {world_size} is not a multiple of {replicate} replicas")
    return init_device_mesh(
        default_device_type(), (replicate, world_size // replicate), mesh_dim_names=("replicate", "shard")
    )


def plan_meshes(world_size: int, replicate: int, tp: int, pp: int = 1):
    """(the mesh `shard` takes, the TP mesh or None) over the default process group: tp == pp == 1: `hsdp_mesh`'s;
    else the mesh (["pp",] ["replicate", "shard" | "dp"] [, "tp"]) of (P, R, world / (P R T), T), one dimension
    per degree above 1 ("dp" without replicas), and shard takes its ("replicate", "shard") or "dp" slice."""

    if tp == 1 and pp == 1:
        return hsdp_mesh(world_size, replicate), None
    if tp < 1 or replicate < 1 or pp < 1 or world_size % (pp * replicate * tp):
        raise ValueError(f"world size {world_size} is not a multiple of pp {pp} x {replicate} replica(s) x tp {tp}")
    shard = world_size // (pp * replicate * tp)
    dims = [("pp", pp)] if pp > 1 else []
    dims += [("replicate", replicate), ("shard", shard)] if replicate > 1 else [("dp", shard)]
    dims += [("tp", tp)] if tp > 1 else []
    mesh = init_device_mesh(
        default_device_type(), tuple(n for _, n in dims), mesh_dim_names=tuple(name for name, _ in dims)
    )
    return (mesh["replicate", "shard"] if replicate > 1 else mesh["dp"]), (mesh["tp"] if tp > 1 else None)


def default_tp_plan(block: nn.Module) -> dict:
    """Column-wise / row-wise styles for the block's Linear layers named in COLWISE_NAMES / ROWWISE_NAMES (the
    last component of the module path). ValueError when the block has none of either."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan, linears = {}, []
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear):
            linears.append(name)
            last = name.rpartition(".")[2]
            if last in COLWISE_NAMES:
                plan[name] = ColwiseParallel()
            elif last in ROWWISE_NAMES:
                plan[name] = RowwiseParallel()
    styles = {type(s).__name__ for s in plan.values()}
    if styles != {"ColwiseParallel", "RowwiseParallel"}:
        raise ValueError(
            f"the default TP plan found no column-wise / row-wise pair among the block's Linear layers "
            f"({', '.join(linears) or 'none'}); it splits layers named {sorted(COLWISE_NAMES)} column-wise and "
            f"{sorted(ROWWISE_NAMES)} row-wise. Give the factory its own plan: factory.tp_plan = "
            "{'mlp.fc_in': ColwiseParallel(), 'mlp.fc_out': RowwiseParallel(), ...}"
        )
    return plan


def tp_plan_for(factory: Callable, block: nn.Module) -> tuple[TPPlan, str]:
    """(the plan for `block` with the factory's `tp_root_plan` as its root plan, where the block plan came from:
    "factory" or "default")."""
    root = getattr(factory, "tp_root_plan", None) or {}
    if not isinstance(root, dict):
        raise ValueError(
            f"the factory's root TP plan (tp_root_plan) is a {type(root).__name__}; expected a dict of root-relative "
            "module names outside the blocks to ParallelStyle objects"
        )
    given = getattr(factory, "tp_plan", None)
    if given is None:
        return TPPlan(default_tp_plan(block), root), "default"
    plan = given(block) if callable(given) else given
    if not isinstance(plan, dict) or not plan:
        raise ValueError(
            f"the factory's TP plan (tp_plan) is a {type(plan).__name__}; expected a non-empty dict of "
            "block-relative module names to ParallelStyle objects"
        )
    return TPPlan(plan, root), "factory"


def plan_text(plan: dict, source: str) -> str:
    """'default plan (Linear names): colwise attn.wq, ...; rowwise attn.wo, ...' or the factory's, by style."""
    by_style: dict[str, list[str]] = {}
    for name, style in plan.items():
        by_style.setdefault(type(style).__name__, []).append(name)
    short = {
        "ColwiseParallel": "colwise",
        "RowwiseParallel": "rowwise",
        "SequenceParallel": "sequence parallel",
        "PrepareModuleInput": "prepared input",
        "PrepareModuleOutput": "prepared output",
    }
    parts = "; ".join(f"{short.get(k, k)} {', '.join(v)}" for k, v in by_style.items())
    where = "the factory's tp_plan" if source == "factory" else "the default plan (Linear layers by name)"
    root = getattr(plan, "root", {})
    if root:
        parts += "; root: " + ", ".join(f"{short.get(type(s).__name__, type(s).__name__)} {n}" for n, s in root.items())
    return f"{where}, per block: {parts}"


def apply_tp(model: nn.Module, tp_mesh, plan: dict) -> int:
    """`parallelize_module(block, tp_mesh, plan)` on every block of the model's block list, then the plan's root
    plan (`TPPlan.root`) on the model; the number of blocks."""
    from torch.distributed.tensor.parallel import parallelize_module

    _, blocks = block_list(model)
    if blocks is None:
        raise ValueError("--tp needs a model with an nn.ModuleList of blocks to apply the TP plan to")
    for block in blocks:
        parallelize_module(block, tp_mesh, dict(plan))
    root = getattr(plan, "root", {})
    if root:
        parallelize_module(model, tp_mesh, root)
    return len(blocks)


def tp_local_copy(model: nn.Module, plan: dict, tp: int) -> list[str]:
    """What one TP rank computes, as a plain model (for the op-by-op trace), in every block and on the root's
    modules of `TPPlan.root`: each Linear of a column-wise style replaced by one with out_features / tp, each
    row-wise Linear by one with in_features / tp, a row-wise Embedding by one with num_embeddings / tp rows (same
    device and dtype; a bias stays whole). Sequence parallelism as the styles say: an input a column-wise Linear or
    a `PrepareModuleInput` takes as Shard(d) and wants replicated is gathered (tp copies concatenated on d: the
    all-gather's buffer); a row-wise output given as Shard(d) is summed down to 1/tp of d (the reduce-scatter), so
    `SequenceParallel` modules and the residual stream run on 1/tp of the sequence, as on a rank. Returns the plan
    entries left as they are."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    _, blocks = block_list(model)
    owners = [(block, plan) for block in blocks or ()] + [(model, getattr(plan, "root", {}))]
    left = []
    for owner, entries in owners:
        for name, style in entries.items():
            try:
                module = owner.get_submodule(name)
            except AttributeError:
                left.append(name)
                continue
            if isinstance(style, SequenceParallel):
                continue  # runs on the sequence shard it is given
            if isinstance(style, PrepareModuleInput):
                dims = [
                    _shard_dim(have) if _shard_dim(have) is not None and _replicated(want) else None
                    for have, want in zip(style.input_layouts or (), style.desired_input_layouts or ())
                ]
                if any(d is not None for d in dims):
                    module.register_forward_pre_hook(_gather_args(dims, tp))
                else:
                    left.append(name)
                continue
            local = _local_module(module, style, tp)
            if local is None:
                left.append(name)
                continue
            if isinstance(style, ColwiseParallel) and _shard_dim(style.input_layouts[0]) is not None:
                local.register_forward_pre_hook(_gather_args([_shard_dim(style.input_layouts[0])], tp))
            if isinstance(style, RowwiseParallel) and _shard_dim(style.output_layouts[0]) is not None:
                local.register_forward_hook(_scatter_output(_shard_dim(style.output_layouts[0]), tp))
            parent, _, attr = name.rpartition(".")
            setattr(owner.get_submodule(parent) if parent else owner, attr, local)
    return sorted(set(left))


def _local_module(module: nn.Module, style, tp: int) -> nn.Module | None:
    """One TP rank's share of a column-wise or row-wise Linear, or of a row-wise Embedding; None for anything else."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(module, nn.Embedding) and isinstance(style, RowwiseParallel):
        w = module.weight
        return nn.Embedding(-(-module.num_embeddings // tp), module.embedding_dim, device=w.device, dtype=w.dtype)
    if not isinstance(module, nn.Linear) or not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return None
    rows, cols = module.out_features, module.in_features
    if isinstance(style, ColwiseParallel):
        rows = -(-rows // tp)
    else:
        cols = -(-cols // tp)
    w = module.weight
    return nn.Linear(cols, rows, bias=module.bias is not None, device=w.device, dtype=w.dtype)


def _shard_dim(layout) -> int | None:
    return layout.dim if layout is not None and layout.is_shard() else None


def _replicated(layout) -> bool:
    return layout is not None and layout.is_replicate()


def _gather_args(dims: list[int | None], tp: int) -> Callable:
    """A forward pre-hook that stands for the all-gather of the positional inputs at `dims` (None: as they are)."""
    from fsdp2_compile.planner.trace import tp_gather

    def hook(_module, args):
        return tuple(
            tp_gather(a, tp, dims[i]) if i < len(dims) and dims[i] is not None else a for i, a in enumerate(args)
        )

    return hook


def _scatter_output(dim: int, tp: int) -> Callable:
    """A forward hook that stands for the reduce-scatter of the output on `dim`: tp partial chunks summed."""

    def hook(_module, _args, out):
        return out.unflatten(dim, (tp, -1)).sum(dim)

    return hook


def tp_collective_s(kind: str, nbytes: float, group: int, alpha_s: float, bytes_per_s: float) -> float:
    """A ring over `group` ranks of the intra-node link: alpha + (G-1)/G x the full buffer / bandwidth, twice the
    bytes for an all-reduce."""
    if group <= 1:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    return alpha_s + factor * (group - 1) / group * nbytes / bytes_per_s
