"""Tensor parallelism for the planner and the CLI (`--tp T`): the (dp, tp) mesh, the TP plan applied to each block
(the factory's own, or a default for Linear layers named like torchtitan's / Hugging Face's), a TP-local copy of a
model for the op-by-op trace, and the time of TP's collectives on the intra-node link.

The plan: a dict of block-relative module names to `torch.distributed.tensor.parallel` styles, applied with
`parallelize_module(block, mesh["tp"], plan)` to every block of the model's longest ModuleList, as torchtitan does.
A factory gives its own with a `tp_plan` attribute (`factory.tp_plan = {...}`, or a callable taking the block and
returning the dict); otherwise `default_tp_plan` pairs Linear layers by name: q/k/v/gate/up (and torchtitan's
wq/wk/wv/w1/w3) column-wise, o/down/proj (wo/w2) row-wise: plain TP, one all-reduce of the activations per row-wise
layer in forward and one per column-wise input in backward. Sequence parallelism (SequenceParallel norms,
all-gather / reduce-scatter of the activations instead) comes with a factory's own plan.
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


def tp_plan_for(factory: Callable, block: nn.Module) -> tuple[dict, str]:
    """(the plan for `block`, where it came from: "factory" or "default")."""
    given = getattr(factory, "tp_plan", None)
    if given is None:
        return default_tp_plan(block), "default"
    plan = given(block) if callable(given) else given
    if not isinstance(plan, dict) or not plan:
        raise ValueError(
            f"the factory's TP plan (tp_plan) is a {type(plan).__name__}; expected a non-empty dict of "
            "block-relative module names to ParallelStyle objects"
        )
    return dict(plan), "factory"


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
    return f"{where}, per block: {parts}"


def apply_tp(model: nn.Module, tp_mesh, plan: dict) -> int:
    """`parallelize_module(block, tp_mesh, plan)` on every block of the model's block list; the number of blocks."""
    from torch.distributed.tensor.parallel import parallelize_module

    _, blocks = block_list(model)
    if blocks is None:
        raise ValueError("--tp needs a model with an nn.ModuleList of blocks to apply the TP plan to")
    for block in blocks:
        parallelize_module(block, tp_mesh, plan)
    return len(blocks)


def tp_local_copy(model: nn.Module, plan: dict, tp: int) -> list[str]:
    """What one TP rank computes, as a plain model (for the op-by-op trace): in every block, each Linear of a
    column-wise style replaced by one with out_features / tp, each row-wise one by in_features / tp (same device and
    dtype; the bias stays whole). Other styles (sequence parallel norms, prepared inputs) are left whole. Returns
    the plan entries left as they are."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    _, blocks = block_list(model)
    left = []
    for block in blocks if blocks is not None else ():
        for name, style in plan.items():
            try:
                linear = block.get_submodule(name)
            except AttributeError:
                left.append(name)
                continue
            if not isinstance(linear, nn.Linear) or not isinstance(style, (ColwiseParallel, RowwiseParallel)):
                left.append(name)
                continue
            rows, cols = linear.out_features, linear.in_features
            if isinstance(style, ColwiseParallel):
                rows = -(-rows // tp)
            else:
                cols = -(-cols // tp)
            w = linear.weight
            new = nn.Linear(cols, rows, bias=linear.bias is not None, device=w.device, dtype=w.dtype)
            parent, _, attr = name.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, attr, new)
    return sorted(set(left))


def tp_collective_s(kind: str, nbytes: float, group: int, alpha_s: float, bytes_per_s: float) -> float:
    """A ring over `group` ranks of the intra-node link: alpha + (G-1)/G x the full buffer / bandwidth, twice the
    bytes for an all-reduce."""
    if group <= 1:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    return alpha_s + factor * (group - 1) / group * nbytes / bytes_per_s
