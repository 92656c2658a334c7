"""A layout as a file a training script builds from (`fsdp2-compile plan --search --emit-config PATH`): the mesh
(shape and dimension names), `shard`'s options (reshard_after_forward, the mixed precision policy), the
`CompileConfig` fields, activation checkpointing, the TP plan and the pipeline's schedule and stage split, with the
figures the planner predicted for it. `load_recipe` reads one back; `build_from_recipe` applies it to a model.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from torch import nn

from fsdp2_compile.config import CompileConfig, MixedPrecisionPolicy
from fsdp2_compile.planner.activation_checkpointing import apply_ac
from fsdp2_compile.planner.block_sharding import shard_blocks
from fsdp2_compile.planner.layout import Layout
from fsdp2_compile.planner.reduced_depth import block_list

__all__ = ["RECIPE_VERSION", "build_from_recipe", "layout_of", "load_recipe", "mesh_of", "recipe_of", "write_recipe"]

RECIPE_VERSION = 1


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"recipe: {name!r} is not a torch dtype")
    return dtype


def mesh_of(lay: Layout) -> tuple[list[int], list[str]]:
    """The mesh's shape and dimension names, as `plan_meshes` builds it: ([pp,] [replicate, shard | dp] [, tp])."""
    dims = [("pp", lay.pp)] if lay.pp > 1 else []
    dims += [("replicate", lay.replicate), ("shard", lay.shard_size)] if lay.replicate > 1 else [("dp", lay.shard_size)]
    dims += [("tp", lay.tp)] if lay.tp > 1 else []
    return [n for _, n in dims], [name for name, _ in dims]


def recipe_of(
    lay: Layout,
    local_batch: int,
    hardware: str,
    predicted: dict,
    tp_plan: str = "",
    seq_len: int | None = None,
    global_batch: int | None = None,
) -> dict:
    """The recipe of a layout (JSON-ready); `seq_len` None: the model factory's default."""
    shape, names = mesh_of(lay)
    return {
        "version": RECIPE_VERSION,
        "world_size": lay.world_size,
        "mesh": {"shape": shape, "dim_names": names},
        "global_batch": global_batch,
        "local_batch": local_batch,
        "seq_len": seq_len,
        "shard": {
            "reshard_after_forward": lay.reshard_after_forward,
            "mp_policy": {
                "param_dtype": _dtype_name(lay.mp_policy.param_dtype),
                "reduce_dtype": _dtype_name(lay.mp_policy.reduce_dtype),
            },
        },
        "compile_config": {"hardware": hardware, "prefetch_depth": lay.prefetch, "keep_gathered": lay.keep_gathered},
        "ac": lay.ac,
        "attention": lay.attention,
        "compiler": lay.compiler,
        "float8": lay.float8,
        "tp": {"degree": lay.tp, "plan": tp_plan},
        "pp": {
            "degree": lay.pp,
            "schedule": lay.pp_schedule if lay.pp > 1 else None,
            "microbatches": lay.microbatches,
            "stages_per_rank": lay.v if lay.pp > 1 else None,
        },
        "predicted": predicted,
    }


def write_recipe(path: str, recipe: dict) -> None:
    with open(path, "w") as f:
        json.dump(recipe, f, indent=2)
        f.write("\n")


def load_recipe(path: str) -> dict:
    """A recipe file, checked: ValueError naming the file and what is wrong."""
    try:
        with open(path) as f:
            recipe = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"recipe {path}: cannot read it ({type(e).__name__}: {e})") from None
    if not isinstance(recipe, dict) or recipe.get("version") != RECIPE_VERSION:
        raise ValueError(f"recipe {path}: not a version {RECIPE_VERSION} recipe (write it with --emit-config)")
    try:
        layout_of(recipe)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"recipe {path}: {type(e).__name__}: {e}") from None
    return recipe


def layout_of(recipe: dict) -> Layout:
    """The recipe's `Layout` (checked as any layout)."""
    shard, pp, cc = recipe["shard"], recipe["pp"], recipe["compile_config"]
    names = recipe["mesh"]["dim_names"]
    shape = dict(zip(names, recipe["mesh"]["shape"], strict=True))
    return Layout(
        recipe["world_size"],
        replicate=shape.get("replicate", 1),
        tp=recipe["tp"]["degree"],
        reshard_after_forward=shard["reshard_after_forward"],
        mp_policy=mp_policy_of(recipe),
        attention=recipe["attention"],
        ac=recipe["ac"],
        compiler=recipe["compiler"],
        prefetch=cc["prefetch_depth"],
        keep_gathered=cc["keep_gathered"],
        pp=pp["degree"],
        microbatches=pp["microbatches"],
        pp_schedule=pp["schedule"] or "1F1B",
        stages_per_rank=pp["stages_per_rank"] if pp["degree"] > 1 and pp["schedule"] == "Interleaved1F1B" else None,
        float8=recipe["float8"],
    )


def mp_policy_of(recipe: dict) -> MixedPrecisionPolicy:
    mp = recipe["shard"]["mp_policy"]
    return MixedPrecisionPolicy(param_dtype=_dtype(mp["param_dtype"]), reduce_dtype=_dtype(mp["reduce_dtype"]))


def compile_config_of(recipe: dict) -> CompileConfig:
    cc = recipe["compile_config"]
    return CompileConfig(
        hardware=cc["hardware"], prefetch_depth=cc["prefetch_depth"], keep_gathered=cc["keep_gathered"]
    )


def build_from_recipe(model: nn.Module, recipe: dict, factory: Callable | None = None) -> nn.Module:
    """Apply the recipe to `model` in place, as the planner planned it: activation checkpointing of its blocks,
    the TP plan (`factory.tp_plan` or the default) on the mesh's "tp" dimension, `shard` of each block then
    `shard_compile` of the root over the data-parallel dimensions. Needs the default process group of the
    recipe's world size. A pipeline recipe (pp > 1) is refused: split the model into its stages first
    (`recipe["pp"]`, torch.distributed.pipelining), then build each stage's module with a pp = 1 recipe. A float8
    recipe expects the model already converted with torchao (docs/parallelisms.md)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_compile.api import shard_compile
    from fsdp2_compile.planner.tensor_parallel import apply_tp, tp_plan_for

    lay = layout_of(recipe)
    if lay.pp > 1:
        raise ValueError(
            f"recipe with pp {lay.pp} ({recipe['pp']['schedule']}): build_from_recipe builds one pipeline stage's "
            "module; split the model into its stages with torch.distributed.pipelining first"
        )
    if dist.get_world_size() != lay.world_size:
        raise ValueError(
            f"recipe for {lay.world_size} ranks, but the default process group has {dist.get_world_size()}; "
            "launch as many ranks as the recipe's world_size"
        )
    shape, names = recipe["mesh"]["shape"], recipe["mesh"]["dim_names"]
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", tuple(shape), mesh_dim_names=tuple(names))
    dp_mesh = mesh["replicate", "shard"] if lay.replicate > 1 else mesh["dp"]
    if lay.ac != "none":
        apply_ac(model, lay.ac)
    if lay.tp > 1:
        _, blocks = block_list(model)
        plan, _ = tp_plan_for(factory, blocks[0])
        apply_tp(model, mesh["tp"], plan)
    kwargs = {"reshard_after_forward": lay.reshard_after_forward, "mp_policy": lay.mp_policy}
    shard_blocks(model, dp_mesh, **kwargs)
    return shard_compile(model, dp_mesh, compile_config=compile_config_of(recipe), **kwargs)
