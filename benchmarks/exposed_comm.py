"""Where a training step waits for communication: one profiled step (after warm-up) of `step_time.py`'s GPT on
rank 0, printed as a timeline of forward / backward / optimizer, every collective gloo ran (its worker thread) and
every wait the step blocked on. A wait that lasts is communication nothing hid.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 benchmarks/exposed_comm.py --mode full
    ip netns exec fsdp2bench ...   # the same inside benchmarks/run.py's 1 Gbit/s namespace

Options as step_time.py's (--mode, --layers, --d-model, ...); --min-ms hides shorter events (default 5).
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(__file__))
import step_time  # noqa: E402

PHASES = ("forward", "backward", "optimizer")
COMM = ("gloo:", "wait_tensor")


def main() -> None:
    parser = step_time.argument_parser()
    parser.description = __doc__
    parser.add_argument("--min-ms", type=float, default=5.0, help="hide events shorter than this")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = step_time.build(args)
    step_optimizer = step_time.optimizer_step(model, args.optimizer_in_backward)
    local = args.batch // world

    def step(seed: int) -> float:
        x, y = step_time.make_batch(model.cfg, args.batch, args.seq, seed=seed)
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        dist.barrier()
        start = time.perf_counter()
        with record_function("forward"):
            loss = step_time.gpt_loss(model(x), y)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            step_optimizer()
        return time.perf_counter() - start

    for seed in range(args.warmup + 1):
        step(seed)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds = step(args.warmup + 1)
    if rank == 0:
        events = [e for e in prof.events() if e.name in PHASES or any(c in e.name for c in COMM)]
        t0 = min(e.time_range.start for e in events)
        waited = 0.0
        print(f"{'start ms':>9} {'ms':>8}  event")
        for e in sorted(events, key=lambda e: e.time_range.start):
            ms = (e.time_range.end - e.time_range.start) / 1e3
            waited += ms if "wait_tensor" in e.name else 0.0
            if e.name in PHASES or ms >= args.min_ms:
                where = "" if e.name in PHASES else ("  (gloo thread)" if e.name.startswith("gloo:") else "  (blocked)")
                print(f"{(e.time_range.start - t0) / 1e3:9.1f} {ms:8.1f}  {e.name}{where}")
        print(f"step {seconds * 1e3:.0f} ms, of which waiting for communication {waited:.0f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
