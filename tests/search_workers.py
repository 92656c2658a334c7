"""Per-rank job for tests/test_search.py: a model built from a recipe the search wrote, one training step."""

from __future__ import annotations

import copy

import torch
from cli_factories import llama_small

from fsdp2_compile.planner.recipe import build_from_recipe, load_recipe


def recipe_step(rank: int, world_size: int, path: str) -> dict:
    """The recipe's model (real weights) sharded and compiled as the recipe says, one forward and backward on this
    rank's share of a global batch, beside the unsharded model's loss on the same share."""
    recipe = load_recipe(path)
    local, seq = recipe["local_batch"], recipe["seq_len"]
    torch.manual_seed(0)
    model, _, loss_fn = llama_small(batch=local, seq=seq, device="cpu")
    reference = copy.deepcopy(model)
    build_from_recipe(model, recipe)
    tokens = torch.randint(0, 1000, (local * world_size, seq), generator=torch.Generator().manual_seed(1))
    mine = tokens[rank * local : (rank + 1) * local]
    loss = loss_fn(model(mine))
    loss.backward()
    placements = {n: (type(p).__name__, p.device_mesh.mesh_dim_names) for n, p in model.named_parameters()}
    return {"loss": loss.item(), "reference": loss_fn(reference(mine)).item(), "placements": placements}
