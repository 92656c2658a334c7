"""The host cost of a training step where nothing needs communicating: one process, a gloo world of one, a GPT
whose compute is tiny (16 layers of d 64, a few tokens), so a step's time is mostly the host's work per op.

    .venv/bin/python benchmarks/host_cost.py [--layers 16 --d-model 64 --runs 6 --steps 20]

Systems: fsdp2 (`fully_shard` per block and on the root, eager) and ours (`shard` per block, `shard_compile` on the
root, the default `CompileConfig`). Both are built and warmed up in the same process, then timed in alternation
(`--runs` rounds, the order reversed every other round, `--steps` steps each); prints one JSON line: per system the
median over rounds of each round's median step, the ratio ours / fsdp2, and the collectives our compiled graphs
hold per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, GPTConfig, gpt_loss, make_batch  # noqa: E402

import fsdp2_compile as fc  # noqa: E402
from fsdp2_compile.compiler.report import collectives, compiled_graphs  # noqa: E402

SYSTEMS = ("fsdp2", "ours")


def build(system: str, args) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.d_model
    )
    model = GPT(cfg)
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        for block in model.blocks:
            fc.shard(block)
        fc.shard_compile(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step_seconds(model, opt, x, y) -> float:
    start = time.perf_counter()
    gpt_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="timed steps per system and round")
    p.add_argument("--runs", type=int, default=6, help="rounds, the systems alternated")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    built = {system: build(system, args) for system in SYSTEMS}
    x, y = make_batch(built["ours"][0].cfg, args.batch, args.seq, seed=0)
    for model, opt in built.values():
        for _ in range(args.warmup):
            step_seconds(model, opt, x, y)
    rounds: dict[str, list[float]] = {system: [] for system in SYSTEMS}
    for r in range(args.runs):
        for system in SYSTEMS if r % 2 == 0 else reversed(SYSTEMS):
            model, opt = built[system]
            rounds[system].append(statistics.median(step_seconds(model, opt, x, y) for _ in range(args.steps)))
    median = {system: statistics.median(seconds) for system, seconds in rounds.items()}
    graphs = [r for r in compiled_graphs() if r.kind in ("forward", "backward")]
    print(
        json.dumps(
            dict(
                layers=args.layers,
                d_model=args.d_model,
                median_step_ms={s: round(v * 1e3, 3) for s, v in median.items()},
                ours_vs_fsdp2=round(median["ours"] / median["fsdp2"], 3),
                rounds_ms={s: [round(v * 1e3, 3) for v in seconds] for s, seconds in rounds.items()},
                collectives_per_step=sum(len(collectives(r.gm)) for r in graphs),
            )
        ),
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
