"""Per-rank jobs for tests/test_good_guest.py."""

from __future__ import annotations

import torch
from models import make_model

import fsdp2_compile as fc


def random_draws_after_sharding(rank: int, world_size: int) -> dict:
    """What the default generator draws after `fully_shard` and after `shard_compile` of the same seeded model, and
    the dropout mask of its first training forward under each."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    for system in ("fsdp2", "ours"):
        torch.manual_seed(0)
        model = make_model("gpt")
        for block in model.blocks:
            (fully_shard if system == "fsdp2" else fc.shard)(block)
        fully_shard(model) if system == "fsdp2" else fc.shard_compile(model)
        out[system] = torch.rand(8)
        out[system + "_dropout"] = torch.nn.functional.dropout(torch.ones(64), p=0.5)
    return out
