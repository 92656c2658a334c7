"""One benchmark job (run under torchrun): median training-step time of a GPT on gloo for one mode.

    torchrun --nproc-per-node 2 benchmarks/step_time.py --mode full [--layers 8 --d-model 512 ...]

Modes: fsdp2 (FSDP2 eager: fully_shard per block + root), plain (our pipeline without bucketing, reordering or
scheduling), full (bucketed, reordered, scheduled), inductor (full, compiled by Inductor), keep-quarter (full, with
selective unsharding keeping a quarter of the gathered parameter bytes from forward to backward), compute (one
process, the unsharded model in eager on one rank's share of the batch: the compute alone, no communication; run
it with --nproc-per-node 1 and --batch set to the per-rank batch), backend-route (full, compiled with
`torch.compile(model, backend=...)` after `shard`: that route does not look for post-accumulate-grad hooks, so
with --optimizer-in-backward autograd runs them after the whole compiled backward, as before the graph delivered
gradients itself). --optimizer-in-backward: FSDP2's recipe, one AdamW per parameter stepped by a
post-accumulate-grad hook instead of one `opt.step()` after backward.
--compile-cache: CompileConfig(compile_cache=True), the compiled graphs saved in and loaded from torch's AOTAutograd
cache under $TORCHINDUCTOR_CACHE_DIR (set it per launch to choose a cold or a warm cache).
Prints one JSON line (rank 0): median/mean step seconds after warm-up, first-step seconds, seconds from this
process's first line to the end of its first step (imports, process group, model built and wrapped, first step: what
a relaunch waits before it trains), compile seconds (torch's
own timers, the slowest rank), rank 0's compile-cache events ("hit", "miss", "stored", "bypass"), peak RSS per
rank, collectives and bytes per step (none for graphs loaded from the cache, which record no graph).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import time

LAUNCHED = time.perf_counter()  # before torch's import: a relaunch waits for that too

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, GPTConfig, gpt_loss, make_batch  # noqa: E402

import fsdp2_compile as fc  # noqa: E402
from fsdp2_compile.api import make_backend  # noqa: E402
from fsdp2_compile.compiler.compile_cache import cache_events  # noqa: E402
from fsdp2_compile.compiler.graph_records import collectives, compiled_graphs  # noqa: E402

CONFIGS = {
    "plain": fc.CompileConfig(buckets="none", prefetch=False, schedule=False),
    "full": fc.CompileConfig(),
    "inductor": fc.CompileConfig(compiler="inductor"),
    "keep-quarter": fc.CompileConfig(keep_gathered=0.25),
    "backend-route": fc.CompileConfig(),
}


def build(args) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.d_model
    )
    model = GPT(cfg)
    if args.mode == "compute":
        return model
    if args.mode in ("fsdp2", "fsdp2-compiled"):
        from torch.distributed.fsdp import fully_shard

        for i, block in enumerate(model.blocks):
            if args.mode == "fsdp2-compiled":  # torchtitan's way: each block compiled (Inductor), then sharded
                block = model.blocks[i] = torch.compile(block)
            fully_shard(block)
        fully_shard(model)
    else:
        for block in model.blocks:
            fc.shard(block)
        config = CONFIGS[args.mode]
        if args.prefetch_depth is not None:
            config = dataclasses.replace(config, prefetch_depth=args.prefetch_depth)
        if args.budget_mib is not None:
            config = dataclasses.replace(config, memory_budget_bytes=int(args.budget_mib * 2**20))
        if args.compile_cache:  # off by default: the first step compiles
            config = dataclasses.replace(config, compile_cache=True)
        if args.mode == "backend-route":
            fc.shard(model)
            return torch.compile(model, backend=make_backend(config))
        fc.shard_compile(model, compile_config=config)
    return model


def optimizer_step(model: torch.nn.Module, in_backward: bool):
    """A function that steps the optimizer after backward: AdamW over all parameters, or (`in_backward`) nothing,
    with one AdamW per parameter stepped by its post-accumulate-grad hook (FSDP2's optimizer in backward)."""
    if not in_backward:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return lambda: (opt.step(), opt.zero_grad())
    optimizers = {p: torch.optim.AdamW([p], lr=1e-4) for p in model.parameters()}

    def hook(p):
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    return lambda: None


def argument_parser() -> argparse.ArgumentParser:
    """This job's options (also `exposed_comm.py`'s)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["fsdp2", "fsdp2-compiled", "compute", *CONFIGS], required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--steps", type=int, default=6, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prefetch-depth", type=int, help="override CompileConfig.prefetch_depth")
    p.add_argument("--budget-mib", type=float, help="override CompileConfig.memory_budget_bytes (MiB)")
    p.add_argument(
        "--compile-cache",
        action="store_true",
        help="CompileConfig(compile_cache=True) (warm restarts): saved in and loaded from $TORCHINDUCTOR_CACHE_DIR",
    )
    p.add_argument("--losses", action="store_true", help="also print every step's loss (exact, as hex)")
    p.add_argument("--optimizer-in-backward", action="store_true", help="an AdamW per parameter, stepped by its hook")
    return p


def compile_seconds() -> float:
    """Seconds this process spent compiling, by torch's own timers: Dynamo's frame compiles (its tracing and the
    backend: AOTAutograd, the partition and the forward passes) and AOTAutograd's lazy backward compiles. Unlike
    the first step minus a median step, this leaves out what any first step does once (the optimizer's state
    allocated, memory touched for the first time)."""
    from fsdp2_compile._torch_private import compile_times

    names, seconds = compile_times(repr="csv", aggregate=True)
    phases = dict(zip(names, seconds))
    return sum(float(phases.get(k, 0.0)) for k in ("_compile.compile_inner", "backward._backward_impl"))


def main() -> None:
    p = argument_parser()
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args)
    step_optimizer = optimizer_step(model, args.optimizer_in_backward)
    cfg = model.cfg
    local = args.batch // world
    times, losses = [], []
    ready_s = None
    for step in range(args.warmup + args.steps):
        x, y = make_batch(cfg, args.batch, args.seq, seed=step)
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        dist.barrier()
        start = time.perf_counter()
        loss = gpt_loss(model(x), y)
        loss.backward()
        step_optimizer()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        ready_s = ready_s or time.perf_counter() - LAUNCHED
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.int64)
    every = torch.zeros(world, dtype=torch.int64)
    dist.all_gather_into_tensor(every, rss)
    compiling = torch.tensor([compile_seconds()], dtype=torch.float64)
    dist.all_reduce(compiling, op=dist.ReduceOp.MAX)
    timed = times[args.warmup :]
    graphs = [r for r in compiled_graphs() if r.kind in ("forward", "backward")]
    colls = [c for r in graphs for c in collectives(r.gm)]
    if rank == 0:
        print(
            json.dumps(
                dict(
                    mode=args.mode,
                    layers=args.layers,
                    world=world,
                    optimizer_in_backward=args.optimizer_in_backward,
                    params=sum(p.numel() for p in model.parameters()),
                    median_s=statistics.median(timed),
                    mean_s=statistics.mean(timed),
                    first_step_s=times[0],
                    launch_to_first_step_s=ready_s,
                    cache=cache_events(),
                    compile_s=compiling.item(),
                    peak_rss_mib=[int(b) / 2**20 for b in every.tolist()],
                    collectives_per_step=len(colls) or None,
                    bytes_per_step=sum(c.nbytes for c in colls) or None,
                    **(dict(losses=[float.hex(v) for v in losses]) if args.losses else {}),
                    exposed_comm_estimate_s=sum(r.timeline.exposed_comm_s for r in graphs if r.timeline)
                    if graphs
                    else None,
                )
            ),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
