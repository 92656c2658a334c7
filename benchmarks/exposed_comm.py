"""Where a training step waits for communication: one profiled step (after warm-up) of `step_time.py`'s GPT on
rank 0, printed as a timeline of forward / backward / optimizer, every collective gloo ran (its worker thread) and
every wait the step blocked on. A wait that lasts is communication nothing hid.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 benchmarks/exposed_comm.py --mode full
    ip netns exec fsdp2bench ...   # the same inside benchmarks/run.py's 1 Gbit/s namespace

Options as step_time.py's (--mode, --layers, --d-model, ...); --min-ms hides shorter events (default 5);
--json PATH also writes every event, with its lane (phase, collective or wait), to PATH (what figures.py draws);
--repeat N profiles N steps and shows the fastest (the one other processes on the machine disturbed least).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(__file__))
import step_time  # noqa: E402

PHASES = ("forward", "backward", "optimizer")
WAITS = ("wait_tensor", "FSDP::all_gather_copy_out", "FSDP::post_backward_reduce")
"""Where a step blocks on communication: the compiled graph's waits; fully_shard's waits sit inside its all-gather
copy-out and its gradient reduction (each with its copies)."""
COMM = ("gloo:", *WAITS)


def main() -> None:
    parser = step_time.argument_parser()
    parser.description = __doc__
    parser.add_argument("--min-ms", type=float, default=5.0, help="hide events shorter than this")
    parser.add_argument("--json", metavar="PATH", help="also write every event and its lane to PATH")
    parser.add_argument("--repeat", type=int, default=1, help="profile this many steps, show the fastest")
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
    profiled = []
    for seed in range(args.warmup + 1, args.warmup + 1 + args.repeat):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            profiled.append((step(seed), prof))
    seconds, prof = min(profiled, key=lambda sp: sp[0])
    if rank == 0:
        events = [e for e in prof.events() if e.name in PHASES or any(c in e.name for c in COMM)]
        t0 = min(e.time_range.start for e in events)
        rows = [
            dict(
                name=e.name,
                lane=lane_of(e.name),
                start_ms=(e.time_range.start - t0) / 1e3,
                ms=(e.time_range.end - e.time_range.start) / 1e3,
            )
            for e in sorted(events, key=lambda e: e.time_range.start)
        ]
        waited = sum(r["ms"] for r in rows if r["lane"] == "wait")
        where = {"phase": "", "collective": "  (gloo thread)", "wait": "  (blocked)"}
        print(f"{'start ms':>9} {'ms':>8}  event")
        for r in rows:
            if r["lane"] == "phase" or r["ms"] >= args.min_ms:
                print(f"{r['start_ms']:9.1f} {r['ms']:8.1f}  {r['name']}{where[r['lane']]}")
        print(f"step {seconds * 1e3:.0f} ms, of which waiting for communication {waited:.0f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(mode=args.mode, step_ms=seconds * 1e3, waited_ms=waited, events=rows), f, indent=1)
    dist.destroy_process_group()


def lane_of(name: str) -> str:
    """phase (forward, backward, optimizer), collective (run on gloo's worker thread) or wait (the step blocked)."""
    return "phase" if name in PHASES else "collective" if name.startswith("gloo:") else "wait"


if __name__ == "__main__":
    main()
