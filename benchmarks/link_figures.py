"""Seconds per all-gather between the ranks of this job, small and large, and the alpha-beta figures they give
(alpha: the small one; beta: seconds per byte each rank sends), and the time of a reduce-scatter and of an
all-reduce of the large all-gather's full buffer over that all-gather's (a ring moves as much in a reduce-scatter
as in an all-gather, twice that in an all-reduce), and of an all-to-all of that buffer (what a two-rank
reduce-scatter runs as, `passes/reduce_scatter_by_all_to_all.py`); for the planner's link profiles. Run under torchrun,
inside the benchmark's shaped network namespace for the shaped link (benchmarks/run.py creates it):

    ip netns exec fsdp2bench .venv/bin/torchrun --nproc-per-node 2 benchmarks/link_figures.py   # 1 Gbit/s tbf
    .venv/bin/torchrun --nproc-per-node 2 benchmarks/link_figures.py                            # loopback

Each time is the median of `--repeat` runs after one warm-up, the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def seconds(collective, repeat: int) -> float:
    """Median seconds of `collective()` over `repeat` runs after one warm-up, max over ranks."""
    samples = []
    for _ in range(repeat + 1):
        dist.barrier()
        start = time.perf_counter()
        collective()
        samples.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(samples[1:])], dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return t.item()


def all_gather(numel: int):
    """An all-gather of `numel` fp32 elements per rank."""
    x, out = torch.zeros(numel), torch.empty(numel * dist.get_world_size())
    return lambda: dist.all_gather_into_tensor(out, x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--large-mib", type=float, default=16.0, help="per-rank size of the large all-gather")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    small, large = 256, int(args.large_mib * 2**20 / 4)
    t_small, t_large = seconds(all_gather(small), args.repeat), seconds(all_gather(large), args.repeat)
    full, shard = torch.zeros(large * world), torch.empty(large)
    t_rs = seconds(lambda: dist.reduce_scatter_tensor(shard, full), args.repeat)
    t_ar = seconds(lambda: dist.all_reduce(full), args.repeat)
    received = torch.empty(large * world)  # what passes/reduce_scatter_by_all_to_all.py sends instead on two ranks
    t_a2a = seconds(lambda: dist.all_to_all_single(received, full), args.repeat)
    sent = (world - 1) * (large - small) * 4  # bytes each rank sends in a ring all-gather, beyond the small one
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "world": world,
                    "small_s": t_small,
                    "large_s": t_large,
                    "alpha_s": t_small,
                    "bytes_per_s_per_rank": sent / (t_large - t_small),
                    "reduce_scatter_s": t_rs,
                    "all_reduce_s": t_ar,
                    "all_to_all_s": t_a2a,
                    "reduce_scatter_over_all_gather": t_rs / t_large,
                    "all_reduce_over_all_gather": t_ar / t_large,
                    "all_to_all_over_all_gather": t_a2a / t_large,
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
