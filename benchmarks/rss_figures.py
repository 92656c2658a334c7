"""Where a rank's peak RSS goes, for the planner's CPU memory figures: run under torchrun, it trains the GPT of
benchmarks/step_time.py (full pipeline: `shard` per block, `shard_compile` on the root, AdamW) and prints, on rank 0:
RSS at points of the run, the bytes of live tensors (the c10 CPU allocator's, from torch.profiler's memory events on
the last step, plus the parameters and optimizer states alive before it), the runtime (RSS after the last step -
the tensors alive then) and the glibc factor: (peak RSS - runtime) / live tensor peak.

MALLOC_MMAP_THRESHOLD_=131072 in the environment fixes glibc's mmap threshold, so every tensor over 128 KiB is
mmapped and returned when freed: RSS then follows the live bytes and the runtime is the process's own memory. With
glibc's default (a threshold that rises to the largest block freed, up to 32 MiB) freed tensors stay in the heap;
pass the fixed run's runtime as --runtime-mib to the default run for its factor:

    MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 benchmarks/rss_figures.py
    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 benchmarks/rss_figures.py --runtime-mib <runtime_mib>
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, GPTConfig, gpt_loss, make_batch  # noqa: E402

import fsdp2_compile as fc  # noqa: E402

MIB = 2**20


def rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--steps", type=int, default=4, help="steps before the profiled one")
    p.add_argument("--runtime-mib", type=float, help="the runtime for the factor (default: this run's)")
    args = p.parse_args()
    points = {"after import torch and fsdp2_compile": rss()}
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    points["after init_process_group"] = rss()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=8, d_model=args.d_model)
    model = GPT(cfg)
    points["after building the full model"] = rss()
    for block in model.blocks:
        fc.shard(block)
    fc.shard_compile(model, compile_config=fc.CompileConfig())
    points["after shard_compile"] = rss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    local = args.batch // world

    def step(seed: int) -> None:
        x, y = make_batch(cfg, args.batch, args.seq, seed=seed)
        loss = gpt_loss(model(x[rank * local : (rank + 1) * local]), y[rank * local : (rank + 1) * local])
        loss.backward()
        opt.step()
        opt.zero_grad()

    for seed in range(args.steps):
        step(seed)
        points[f"after step {seed}"] = rss()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    before = local_bytes(model.parameters()) + local_bytes(
        t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)
    )
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(args.steps)
    live = peak = 0
    for _, nbytes in sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    ):
        live += nbytes
        peak = max(peak, live)
    runtime = points[f"after step {args.steps - 1}"] - before
    factor_runtime = runtime if args.runtime_mib is None else args.runtime_mib * MIB
    if rank == 0:
        print(
            json.dumps(
                {
                    "model": vars(args),
                    "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "default"),
                    "rss_mib": {k: round(v / MIB) for k, v in points.items()},
                    "peak_rss_mib": round(peak_rss / MIB),
                    "tensors_before_step_mib": round(before / MIB, 1),
                    "live_tensor_peak_mib": round((before + peak) / MIB, 1),
                    "runtime_mib": round(runtime / MIB),
                    "glibc_factor": round((peak_rss - factor_runtime) / (before + peak), 3),
                },
                indent=1,
            ),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
