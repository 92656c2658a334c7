"""A small sharded, compiled model trained a few steps: on ranks of the test harness, and as a script under torchrun
(`python -m torch.distributed.run --standalone --max-restarts 1 --nproc-per-node 2 tests/restart_workers.py OUT`),
where in the first attempt rank 1 exits in the middle of the first call's rank-consistency exchange, after it
published its record and before the verdict, and torchrun's agent restarts both ranks.

Under torchrun each rank writes OUT/attempt<N>-rank<R>.json: the store keys of every exchange it published to (the
prefixes under which the exchange's keys lie) and, when it trained, its losses.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import fsdp2_compile as fc

STEPS = 3


def train(rank: int, world_size: int) -> list[float]:
    """Losses of `STEPS` steps of a two-layer MLP sharded per layer, on data seeded by the rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    for layer in (model[0], model[2]):
        fc.shard(layer)
    model = fc.shard_compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _main(out: str) -> None:
    from fsdp2_compile.runtime import rank_agreement

    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    path = os.path.join(out, f"attempt{attempt}-rank{rank}.json")
    record: dict = {"keys": [], "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}
    publish = rank_agreement._Exchange.publish

    def publish_then_maybe_exit(self, text: str) -> None:
        record["keys"] += [ch.key for ch in self.channels]
        publish(self, text)
        if (attempt, rank, self.kind) == (0, 1, "first-call"):
            with open(path, "w") as f:
                json.dump(record, f)
            os._exit(17)  # published, the verdict not read: the other rank is left in the exchange

    rank_agreement._Exchange.publish = publish_then_maybe_exit
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        record["losses"] = train(rank, dist.get_world_size())
    finally:
        with open(path, "w") as f:
            json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1])
