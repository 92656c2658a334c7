"""Does a started gloo all-gather progress while the rank sleeps or computes?

    torchrun --nproc-per-node 2 benchmarks/gloo_overlap_probe.py [--mib 8] [--seconds 0.17]
    ip netns exec NS torchrun ...   # inside a namespace whose loopback is shaped with tc tbf (see run.py)

Prints, on rank 0, the median time of the all-gather alone, and of "issue the all-gather, sleep (or run matmuls)
for --seconds, then wait" — through the functional collectives the compiled graphs use and through
`async_op=True`. Overlapped times near max(comm, work) mean the collective progresses in the background; near
comm + work, it does not.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from fsdp2_compile._torch_private import functional_collectives as funcol


def median_time(fn, repeat: int = 5) -> float:
    samples = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[repeat // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=8.0, help="all-gather input per rank")
    parser.add_argument("--seconds", type=float, default=0.17, help="work done while the all-gather runs")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world, group = dist.get_world_size(), dist.group.WORLD.group_name
    x = torch.randn(int(args.mib * 2**20) // 4)
    a = torch.randn(384, 384)

    def compute() -> None:
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            a @ a

    comm = median_time(lambda: funcol.wait_tensor(funcol.all_gather_into_tensor(x, world, group)))
    for label, work in (("sleep", lambda: time.sleep(args.seconds)), ("compute", compute)):

        def functional(work=work) -> None:
            started = funcol.all_gather_into_tensor(x, world, group)
            work()
            funcol.wait_tensor(started)

        def async_op(work=work) -> None:
            handle = dist.all_gather_into_tensor(torch.empty(world * x.numel()), x, async_op=True)
            work()
            handle.wait()

        t_functional, t_async = median_time(functional), median_time(async_op)
        if dist.get_rank() == 0:
            print(
                f"{label:8s} comm {comm:.3f} s  work {args.seconds:.3f} s  overlapped: functional "
                f"{t_functional:.3f} s, async_op {t_async:.3f} s"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
