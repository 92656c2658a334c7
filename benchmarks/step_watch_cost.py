"""What the step watch's count check costs a CPU training step (run under torchrun, gloo).

    torchrun --nproc-per-node 2 benchmarks/step_watch_cost.py [--layers 4 --d-model 256 --runs 6 --steps 10]

Builds one GPT twice (`shard` per block, `shard_compile` on the root): with the default `CompileConfig` (counts
gathered before each compiled graph runs) and with `check_rank_consistency=False` (not gathered). Both are warmed
up, then timed in alternation (`--runs` rounds, the order reversed every other round, `--steps` steps each); also
times the check alone (`--calls` gathers of the counts). Prints one JSON line (rank 0): the median over rounds of
each round's median step, their ratio, and the check's median time per call.
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
from fsdp2_compile.compiler import step_watch  # noqa: E402


def config(args) -> GPTConfig:
    return GPTConfig(vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=4, d_model=args.d_model)


def build(args, check: bool):
    torch.manual_seed(0)
    model = GPT(config(args))
    for block in model.blocks:
        fc.shard(block)
    model = fc.shard_compile(model, compile_config=fc.CompileConfig(check_rank_consistency=check))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, opt, batch) -> None:
    tokens, targets = batch
    loss = gpt_loss(model(tokens), targets)
    loss.backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    batch = make_batch(config(args), args.batch // dist.get_world_size(), args.seq, dist.get_rank())
    systems = {"check": build(args, True), "no check": build(args, False)}
    for model, opt in systems.values():
        for _ in range(3):
            step(model, opt, batch)
    medians: dict[str, list[float]] = {name: [] for name in systems}
    for run in range(args.runs):
        for name in list(systems)[:: 1 if run % 2 == 0 else -1]:
            model, opt = systems[name]
            times = []
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                step(model, opt, batch)
                times.append(time.perf_counter() - start)
            medians[name].append(statistics.median(times))
    group = step_watch._Group(dist.group.WORLD.group_name, list(range(dist.get_world_size())), 60.0)
    dist.barrier()
    calls = []
    for _ in range(args.calls):
        start = time.perf_counter()
        step_watch._check_aligned([group], "forward:1:0:0")
        calls.append(time.perf_counter() - start)
    result = {name: round(statistics.median(m) * 1e3, 2) for name, m in medians.items()}
    result["ratio"] = round(result["check"] / result["no check"], 3)
    result["check_us_per_call"] = round(statistics.median(calls) * 1e6, 1)
    result.update(layers=args.layers, d_model=args.d_model, world_size=dist.get_world_size(), torch=torch.__version__)
    if dist.get_rank() == 0:
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
